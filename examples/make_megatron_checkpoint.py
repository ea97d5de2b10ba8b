"""Write tiny, real verl-style Megatron checkpoints on CPU (test fixtures and a demo).

Each variant is a Megatron-Core ``GPTModel`` built under a gloo process group (TP x PP ranks
forked by ``torch.multiprocessing`` after megatron-core is imported once, default TP=2, PP=2), given deterministic non-trivial
weights (norms != 1, biases != 0), and saved with Megatron's own ``dist_checkpointing``
(``torch_dist`` backend, fully parallel save strategy, the content metadata verl passes), as verl's
``save_dist_checkpointing`` does. Around each ``dist_ckpt`` the verl folder layout is created:

- ``v1``: ``<role>/dist_ckpt`` holding model + optimizer (a real Adam step, sharded the way
  Megatron's FP32Optimizer does) + ``rng_state``; ``<role>/huggingface/config.json``;
  ``transformer_config.json``.
- ``v2``: ``ckpt_contents.json`` manifest, ``model/dist_ckpt``, ``optimizer/dist_ckpt``,
  ``extra/dist_ckpt``, ``model/huggingface``.
- ``mbridge``: as v1/v2 but without model tensors in any dist_ckpt; the HF weights are in
  ``huggingface/`` (written by transformers from a random model of the same config).
- ``legacy``: ``<role>/model/mp_rank_XX[_PPP]/model.pt`` = ``torch.save([model.state_dict()])``
  per TP/PP rank (old verl), plus a hidden ``reference_dist_ckpt`` of the same weights.

Reference logits come from Megatron itself: after saving, the same ranks re-initialise at TP=1,
PP=1, reload every checkpoint through ``dist_checkpointing.load`` and run the forward pass on fixed
input ids with an explicit causal attention mask; rank 0 writes ``<out>/<variant>/reference.pt``
(``{"input_ids", "logits"}``).

Requires ``megatron-core`` (tested with 0.16.1, CPU only, no Transformer Engine / Apex). The few
CUDA-only calls on the save / forward path are stubbed (see :func:`_stub_cuda`); the CUDA RNG
tracker is Megatron's own no-op inference tracker. ``HF_MERGE_FIXTURE_LOG=1`` prints timings.

Usage::

    python examples/make_megatron_checkpoint.py OUT_DIR            # the default variant set
    python examples/make_megatron_checkpoint.py OUT_DIR --tp 2 --pp 1 --only qwen2_v1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fork_ranks import rank_start_method

# --------------------------------------------------------------------------------------------
# Model families: one tiny shape per family, plus how it reads in Megatron and in transformers.
# --------------------------------------------------------------------------------------------

VOCAB = 96
SEQ = 12


@dataclass(frozen=True)
class Family:
    hf_architecture: str
    model_type: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    eps: float = 1e-6


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", 32, 4, 2, 8, 64, 4, eps=1e-5),
    "mistral": Family("MistralForCausalLM", "mistral", 32, 4, 1, 8, 48, 4, rope_theta=1e6, eps=1e-5),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", 32, 4, 2, 8, 64, 4, qkv_bias=True, rope_theta=1e6),
    # Qwen3: head_dim * heads (64) != hidden (48), q/k RMSNorm per head.
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", 48, 4, 2, 16, 64, 4, qk_norm=True, rope_theta=1e6),
}


@dataclass(frozen=True)
class Variant:
    """One checkpoint to write: ``<out>/<name>/<role>/...``."""

    name: str
    family: str
    tied: bool = False
    value: bool = False  # verl critic: [1, H] head instead of output_layer
    layout: str = "v2"  # "v1" | "v2" | "legacy" (model/mp_rank_XX_PPP/model.pt per rank)
    mbridge: bool = False  # HF weights in huggingface/, no model tensors in dist_ckpt
    singleton_local_shards: bool = False  # per-layer keys + separate gate/up (`_w`/`_v`)
    with_optimizer: bool = True

    @property
    def role(self) -> str:
        return "critic" if self.value else "actor"


DEFAULT_VARIANTS = [
    Variant("qwen2_v1", "qwen2", layout="v1"),
    Variant("qwen3_tied_v2", "qwen3", tied=True, layout="v2"),
    Variant("llama_v2_singleton", "llama", layout="v2", singleton_local_shards=True),
    Variant("mistral_critic_v2", "mistral", value=True, layout="v2"),
    Variant("qwen2_mbridge_v2", "qwen2", layout="v2", mbridge=True),
    Variant("qwen2_mbridge_v1", "qwen2", layout="v1", mbridge=True),
    Variant("qwen2_legacy_tied", "qwen2", tied=True, layout="legacy"),
]


def hf_config_dict(fam: Family, *, tied: bool) -> dict:
    """The HF config.json of the tiny model (what verl writes into ``huggingface/``)."""
    cfg = {
        "architectures": [fam.hf_architecture],
        "model_type": fam.model_type,
        "vocab_size": VOCAB,
        "hidden_size": fam.hidden,
        "intermediate_size": fam.ffn,
        "num_hidden_layers": fam.layers,
        "num_attention_heads": fam.heads,
        "num_key_value_heads": fam.kv_heads,
        "head_dim": fam.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 128,
        "rms_norm_eps": fam.eps,
        "rope_theta": fam.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": fam.rope_theta},
        "tie_word_embeddings": tied,
        "attention_dropout": 0.0,
        "dtype": "float32",
    }
    if fam.model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if fam.model_type == "mistral":
        cfg["sliding_window"] = None
    if fam.model_type == "qwen3":
        cfg.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    if fam.model_type == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None)
    return cfg


# --------------------------------------------------------------------------------------------
# Megatron side (imported by the parent just before it forks the workers: ``PRELOAD``).
# --------------------------------------------------------------------------------------------


def _stub_cuda() -> None:
    """Make megatron-core's few CUDA-only calls harmless on a CPU-only machine."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]


#: TransformerConfig settings every CPU fixture needs: no dropout, no fused kernels, fp32 on CPU.
CPU_SETTINGS = dict(
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    use_cpu_initialization=True,
    params_dtype=torch.float32,
    pipeline_dtype=torch.float32,
)


def _transformer_config(fam: Family, tp: int, pp: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=fam.layers,
        hidden_size=fam.hidden,
        ffn_hidden_size=fam.ffn,
        num_attention_heads=fam.heads,
        num_query_groups=fam.kv_heads,
        kv_channels=fam.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=fam.eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=fam.qkv_bias,
        qk_layernorm=fam.qk_norm,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        **CPU_SETTINGS,
    )


class _ValueHead(torch.nn.Linear):
    """verl's ``LinearForLastLayer``: a replicated ``[1, H]`` head without bias."""

    def __init__(self, hidden: int):
        super().__init__(hidden, 1, bias=False)

    def forward(self, input_, weight=None, runtime_gather_output=None):  # noqa: D401
        return super().forward(input_).float(), None


def _build_model(fam: Family, var: Variant, tp: int, pp: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _transformer_config(fam, tp, pp)
    spec = get_gpt_layer_local_spec(qk_layernorm=fam.qk_norm, normalization="RMSNorm")
    post = ps.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=128,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=post,
        share_embeddings_and_output_weights=var.tied and not var.value,
        position_embedding_type="rope",
        rotary_base=int(fam.rope_theta),
        parallel_output=False,
    )
    if post and var.value:
        model.output_layer = _ValueHead(fam.hidden)
    return model


def _fill_weights(model, *, tp_rank: int, pp_rank: int) -> None:
    """Deterministic, clearly non-default values (norms != 1, biases != 0) per rank."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            seed = zlib.crc32(f"{name}|pp{pp_rank}|tp{tp_rank if sharded else 0}".encode())
            g = torch.Generator().manual_seed(seed)
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise * (0.5 if "embedding" in name else 0.25))


def _save_dist(sharded_state_dict, ckpt_dir: Path, content_metadata: dict) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    if torch.distributed.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"),
        ps.get_data_parallel_group(with_context_parallel=True),
    )
    dist_checkpointing.save(
        sharded_state_dict,
        str(ckpt_dir),
        sharded_strategy=strategy,
        validate_access_integrity=True,
        content_metadata=content_metadata,
    )
    torch.distributed.barrier()


def _optimizer_state(model, model_sd):
    """A real (CPU) Adam step, sharded the way Megatron's FP32Optimizer does it."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    params = [p for p in model.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    for p in params:
        p.grad = None
    state = opt.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    optim_state_to_sharding_state(state, id_map, exclude_keys="step")
    return state


def _rng_state():
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = [{"torch_rng_state": torch.get_rng_state()}]
    return ShardedObject(
        "rng_state",
        state,
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def _paths(root: Path, var: Variant) -> dict[str, Path]:
    base = root / var.name / var.role
    if var.layout == "legacy":
        # The legacy per-rank files, plus a dist_ckpt of the same weights (outside the checkpoint)
        # that Megatron reloads at TP=1 for the reference logits.
        return {"base": base, "model": root / var.name / "reference_dist_ckpt", "hf": base / "huggingface"}
    if var.layout == "v1":
        return {"base": base, "model": base / "dist_ckpt", "hf": base / "huggingface"}
    return {
        "base": base,
        "model": base / "model" / "dist_ckpt",
        "optimizer": base / "optimizer" / "dist_ckpt",
        "extra": base / "extra" / "dist_ckpt",
        "hf": base / "model" / "huggingface",
    }


def _save_variant(root: Path, var: Variant, tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps

    fam = FAMILIES[var.family]
    model = _build_model(fam, var, tp, pp)
    _fill_weights(
        model, tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank()
    )
    # What verl's MegatronCheckpointManager passes (mcore >= 0.14), unless testing the other form.
    metadata = {"singleton_local_shards": var.singleton_local_shards, "chained_optim_avoid_prefix": True}
    model_sd = model.sharded_state_dict(metadata=metadata)
    paths = _paths(root, var)

    if var.layout == "legacy":  # old verl: torch.save([model.state_dict()]) per TP/PP rank
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        sub = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
        if ps.get_data_parallel_rank() == 0:
            (paths["base"] / "model" / sub).mkdir(parents=True, exist_ok=True)
            torch.save([model.state_dict()], paths["base"] / "model" / sub / "model.pt")
        _save_dist({"model": model_sd}, paths["model"], metadata)
    elif var.layout == "v1":  # one dist_ckpt with model, optimizer and rng state (old verl)
        sd = {"rng_state": _rng_state()}
        if not var.mbridge:
            sd["model"] = model_sd
        if var.with_optimizer:
            sd["optimizer"] = _optimizer_state(model, model.sharded_state_dict(metadata=metadata))
        _save_dist(sd, paths["model"], metadata)
    else:
        if not var.mbridge:
            _save_dist({"model": model_sd}, paths["model"], metadata)
        if var.with_optimizer:
            opt = _optimizer_state(model, model.sharded_state_dict(metadata=metadata))
            _save_dist({"optimizer": opt}, paths["optimizer"], metadata)
        _save_dist({"rng_state": _rng_state()}, paths["extra"], metadata)

    if torch.distributed.get_rank() == 0:
        _write_side_files(paths, var, fam, tp, pp)
    torch.distributed.barrier()


def _write_side_files(paths: dict[str, Path], var: Variant, fam: Family, tp: int, pp: int) -> None:
    hf = paths["hf"]
    hf.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_dict(fam, tied=var.tied)
    (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    tcfg = {
        "num_layers": fam.layers,
        "hidden_size": fam.hidden,
        "num_attention_heads": fam.heads,
        "num_query_groups": fam.kv_heads,
        "kv_channels": fam.head_dim,
        "ffn_hidden_size": fam.ffn,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "expert_model_parallel_size": 1,
        "qk_layernorm": fam.qk_norm,
        "add_qkv_bias": fam.qkv_bias,
        "gated_linear_unit": True,
    }
    base = paths["base"]
    mbridge = var.mbridge
    if var.layout in ("v1", "legacy"):
        if var.layout == "v1":
            (base / "transformer_config.json").write_text(json.dumps(tcfg, indent=2))
        if mbridge:
            _write_hf_weights(hf, cfg)
        return
    (base / "transformer_config.json").write_text(json.dumps(tcfg, indent=2))
    contents: dict = {}
    if mbridge:
        contents["model"] = {"path": "model/huggingface", "format": "huggingface", "backend": "mbridge"}
        contents["hf_config"] = {"path": "model/huggingface", "format": "huggingface"}
    else:
        contents["model"] = {
            "path": "model/dist_ckpt",
            "format": "megatron_dist_checkpoint",
            "backend": "dist_checkpointing",
        }
    if var.with_optimizer:
        contents["optimizer"] = {"path": "optimizer/dist_ckpt", "format": "megatron_dist_checkpoint"}
    contents["rng_state"] = {"path": "extra/dist_ckpt", "format": "megatron_dist_checkpoint", "key": "rng_state"}
    contents["transformer_config"] = {"path": "transformer_config.json", "format": "json"}
    manifest = {
        "schema_version": 2,
        "framework": "megatron",
        "role": var.role,
        "arch": fam.hf_architecture,
        "global_step": 1,
        "world_size": tp * pp,
        "backend": {"has_bridge": mbridge, "use_dist_checkpointing": not mbridge, "peft": False},
        "save_contents": ["model", "optimizer", "extra"],
        "contents": contents,
        "directories": {},
        "saved_any_dist_ckpt": True,
    }
    (base / "ckpt_contents.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    if mbridge:
        _write_hf_weights(hf, cfg)


def _write_hf_weights(hf: Path, cfg: dict) -> None:
    """mbridge case: HF weights already in ``model/huggingface`` (written by transformers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(hf)


def _reference(root: Path, var: Variant) -> None:
    """Reload at TP=1/PP=1 through Megatron and record logits for fixed inputs."""
    from megatron.core import dist_checkpointing

    fam = FAMILIES[var.family]
    model = _build_model(fam, var, 1, 1)
    metadata = {"singleton_local_shards": var.singleton_local_shards, "chained_optim_avoid_prefix": True}
    sd = {"model": model.sharded_state_dict(metadata=metadata)}
    loaded = dist_checkpointing.load(sd, str(_paths(root, var)["model"]))
    model.load_state_dict(loaded["model"], strict=True)
    model.eval()
    g = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
    if torch.distributed.get_rank() == 0:
        torch.save(
            {"input_ids": input_ids, "logits": logits.float().contiguous()},
            root / var.name / "reference.pt",
        )


def _worker(rank: int, world: int, port: int, root: str, variants: list[dict], tp: int, pp: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    _stub_cuda()
    import warnings

    warnings.filterwarnings("ignore")
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    out = Path(root)
    vs = [Variant(**v) for v in variants]
    import time

    t0 = time.perf_counter()
    log = (lambda *a: print(f"[{time.perf_counter() - t0:6.2f}s]", *a, flush=True)) if (rank == 0 and os.environ.get("HF_MERGE_FIXTURE_LOG")) else (lambda *a: None)
    log("start")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    log("mpu")
    for var in vs:
        _save_variant(out, var, tp, pp)
        log("saved", var.name)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    for var in vs:
        if not var.mbridge:
            _reference(out, var)
            log("reference", var.name)
    ps.destroy_model_parallel()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    log("done")
    exit_worker()


def exit_worker() -> None:
    """End a fixture worker: Megatron's saver starts a multiprocessing Manager (a child process
    holding our stdout / stderr); stop it, then skip the slow interpreter teardown (seconds per rank)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What every rank imports, imported once by the parent before it forks the ranks.
PRELOAD = (
    "megatron.core.dist_checkpointing.optimizer",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.tensor_parallel.random",
    "transformers",
)


def make_checkpoints(
    root: Path, variants: list[Variant] = DEFAULT_VARIANTS, *, tp: int = 2, pp: int = 2
) -> dict[str, Path]:
    """Write every variant under ``root``; return ``{name: <root>/<name>/<role>}``."""
    import torch.multiprocessing as mp

    root = Path(root)
    for var in variants:
        shutil.rmtree(root / var.name, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    world = tp * pp
    mp.start_processes(
        _worker,
        args=(world, _free_port(), str(root), [asdict(v) for v in variants], tp, pp),
        nprocs=world,
        join=True,
        start_method=rank_start_method(PRELOAD),
    )
    return {v.name: root / v.name / v.role for v in variants}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    args = ap.parse_args(argv)
    variants = [v for v in DEFAULT_VARIANTS if not args.only or v.name in args.only]
    for name, path in make_checkpoints(args.out, variants, tp=args.tp, pp=args.pp).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
