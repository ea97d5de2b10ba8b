"""Write REAL PyTorch DCP training checkpoints on CPU, one 2-rank gloo run for all of them.

    python examples/make_dcp_checkpoints.py OUT

writes, each with ``reference/`` (the unsharded trained weights as Hugging Face safetensors, in
HF names, plus ``logits.pt``) beside the checkpoint:

- ``OUT/accelerate/ckpt``: ``Accelerator.save_state`` of a tiny Qwen2 trained one AdamW step under
  accelerate's FSDP2 plugin (``pytorch_model_fsdp_0/``, ``optimizer_0/``, ``random_states_*.pkl``).
  On CPU accelerate silently uses DDP and drops the plugin; setting ``distributed_type`` to FSDP
  and ``fsdp_plugin`` on the state (and ``distributed_type`` in ``PartialState._shared_state``)
  before ``prepare`` makes it shard with FSDP2 and save via DCP.
- ``OUT/torchtitan/dump/checkpoint/step-1``: torchtitan 0.3's Llama 3 model (grouped-query
  attention), FSDP2 ``fully_shard`` per layer, one AdamW step, saved by torchtitan's own
  ``CheckpointManager`` (model, optimizer, train state). The reference weights are torchtitan's own
  ``Llama3StateDictAdapter.to_hf`` of the full state dict; ``config/config.json`` is the matching
  HF LlamaConfig; logits are torchtitan's forward (flex attention, no grad) on 128-token sequences.
- ``OUT/torchtitan_qwen3/...``: the same with torchtitan's Qwen3 model (tied embeddings, q/k norms,
  cos/sin rotary: no permutation) and its ``Qwen3StateDictAdapter``.
- ``OUT/dcp_plain/ckpt``: ``dcp.save(model.state_dict())`` of an FSDP2-sharded tied bf16 Llama (HF
  names at the top level), config.json beside it.
- ``OUT/dcp_nested/ckpt``: ``dcp.save({"model": ..., "optimizer": ...})`` (get_state_dict) of an
  FSDP2-sharded Qwen2 after one step (``model.`` + HF names beside ``optimizer.*``).

torchtitan 0.3.0 imports its GPU expert-parallel kernels (``torchtitan.distributed.
minimal_async_ep``, which needs triton) at model import; a stand-in module is registered for it,
nothing else is patched. Its flex attention has no CPU backward, so the training step's loss is a
function of the weights alone (it still runs FSDP2's backward and AdamW).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hf_merge.transformers_compat import dtype_kwargs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fork_ranks import rank_start_method  # noqa: E402

WORLD = 2
SEED = 1234


def _tiny_config(arch: str, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        arch, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **extra,
    )


def _save_reference(model, folder: Path, input_ids: torch.Tensor, logits: torch.Tensor | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if logits is None:
        with torch.no_grad():
            logits = model(input_ids).logits.float()
    torch.save({"input_ids": input_ids, "logits": logits}, folder / "logits.pt")


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _hf_reference(model, rank: int, out: Path, input_ids, arch: str, dtype=torch.float32, *, config_dir: Path, **extra) -> None:
    """Every rank gathers the trained weights; rank 0 writes them as an HF folder + logits, and the
    config (without weights) into ``config_dir``."""
    full = _full_state(model)
    if rank == 0:
        ref = _hf_model(arch, dtype, **extra)
        ref.load_state_dict(full)
        _save_reference(ref.eval(), out / "reference", input_ids)
        ref.config.save_pretrained(config_dir)


def _one_step(model, opt, input_ids) -> None:
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()


def _hf_model(arch: str, dtype=torch.float32, **extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(_tiny_config(arch, **extra), **dtype_kwargs(dtype)).train()


def _accelerate(out: Path, rank: int, input_ids: torch.Tensor) -> None:
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True)
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    acc.state.distributed_type = DistributedType.FSDP  # CPU: accelerate chose DDP and dropped the plugin
    acc.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    model = _hf_model("qwen2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    _one_step(model, opt, input_ids)
    acc.save_state(str(out / "ckpt"))
    _hf_reference(model, rank, out, input_ids, "qwen2", config_dir=out / "config")


def _fsdp_hf(arch: str, dtype, **extra):
    from torch.distributed.fsdp import fully_shard

    model = _hf_model(arch, dtype, **extra)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _dcp_plain(out: Path, rank: int, input_ids: torch.Tensor) -> None:
    import torch.distributed.checkpoint as dcp

    model = _fsdp_hf("llama", torch.bfloat16, tie_word_embeddings=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    _one_step(model, opt, input_ids)
    dcp.save(model.state_dict(), checkpoint_id=str(out / "ckpt"))
    _hf_reference(model, rank, out, input_ids, "llama", torch.bfloat16, config_dir=out / "ckpt", tie_word_embeddings=True)


def _dcp_nested(out: Path, rank: int, input_ids: torch.Tensor) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _fsdp_hf("qwen2", torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _one_step(model, opt, input_ids)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out / "ckpt"))
    _hf_reference(model, rank, out, input_ids, "qwen2", config_dir=out / "config")


# ---- torchtitan ---------------------------------------------------------------------------

TT = dict(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab=128, hidden=96, theta=10000.0, max_seq=128)


def _torchtitan_stand_ins() -> None:
    """torchtitan 0.3.0 imports its triton expert-parallel kernels at model import; stand in."""
    name = "torchtitan.distributed.minimal_async_ep"
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__path__ = []

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    mod.__getattr__ = __getattr__
    sys.modules[name] = mod


def _torchtitan_model(family: str):
    """torchtitan's own model class for ``family`` (llama3: untied, complex rotary; qwen3: tied,
    cos/sin rotary, q/k norms, head_dim 32), with a seeded init of every weight (norms too)."""
    _torchtitan_stand_ins()
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm

    c = TT
    common = dict(n_layers=c["n_layers"], dim=c["dim"], n_heads=c["n_heads"], n_kv_heads=c["n_kv_heads"],
                  hidden_dim=c["hidden"], fuse_qkv=True, attn_backend="flex")
    if family == "llama3":
        from torchtitan.models.llama3 import Llama3Model as Model, Llama3StateDictAdapter as Adapter, _build_llama3_layers

        layers = _build_llama3_layers(**common, rope=ComplexRoPE.Config(dim=c["dim"] // c["n_heads"], max_seq_len=c["max_seq"], theta=c["theta"]))
        tied = False
    else:
        from torchtitan.models.qwen3 import Qwen3Model as Model, Qwen3StateDictAdapter as Adapter, _build_qwen3_layers

        layers = _build_qwen3_layers(**common, head_dim=32, rope=CosSinRoPE.Config(dim=32, max_seq_len=c["max_seq"], theta=c["theta"]))
        tied = True
    cfg = Model.Config(
        dim=c["dim"], vocab_size=c["vocab"], enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=c["vocab"], embedding_dim=c["dim"]),
        norm=RMSNorm.Config(normalized_shape=c["dim"], eps=1e-5 if family == "llama3" else 1e-6),  # as its layers
        lm_head=Linear.Config(in_features=c["dim"], out_features=c["vocab"]),
        layers=layers,
    )
    torch.manual_seed(SEED)
    model = cfg.build()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    return cfg, model, Adapter


def _torchtitan_hf_config(family: str):
    from transformers import AutoConfig

    c = TT
    extra = dict(head_dim=32, tie_word_embeddings=True) if family == "qwen3" else dict(tie_word_embeddings=False)
    arch = {"llama3": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM")}[family]
    # rms_norm_eps: torchtitan's RMSNorm default 1e-5 (llama3 layers), qwen3's builder 1e-6
    return AutoConfig.for_model(
        arch[0], architectures=[arch[1]], vocab_size=c["vocab"], hidden_size=c["dim"], intermediate_size=c["hidden"],
        num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"],
        max_position_embeddings=c["max_seq"], rope_theta=c["theta"], rms_norm_eps=1e-5 if family == "llama3" else 1e-6,
        dtype="float32", **extra,
    )


def _torchtitan(out: Path, rank: int, input_ids: torch.Tensor, family: str = "llama3") -> None:
    from torch.distributed.fsdp import fully_shard

    cfg, model, Adapter = _torchtitan_model(family)
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import default_adamw

    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    loss = sum((p.float() ** 2).sum() for p in model.parameters())  # flex attention: no CPU backward
    loss.backward()
    optimizers.step()
    optimizers.zero_grad()
    manager = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, last_save_model_only=False, keep_latest_k=0),
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
        states={"train_state": _TrainState(step=1)}, sd_adapter=None, base_folder=str(out / "dump"),
    )
    manager.save(curr_step=1, last_step=False)
    manager.maybe_wait_for_saving()
    manager.close()
    # torchtitan keeps one fused wqkv parameter and splits it in a state_dict hook, which
    # get_model_state_dict cannot follow: gather the hook's output instead.
    from torch.distributed.tensor import DTensor

    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        hf = Adapter(cfg, None).to_hf(full)
        from safetensors.torch import save_file

        (out / "reference").mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in hf.items()}, str(out / "reference" / "model.safetensors"))
        _torchtitan_hf_config(family).save_pretrained(out / "config")
        _, ref_model, _ = _torchtitan_model(family)
        ref_model.load_state_dict(full)
        ref_model.eval()
        # flex attention on CPU reads garbage for sequences shorter than its 128-token block
        # (torch 2.13: two forwards of the same input differ): use one full block.
        input_ids = torch.randint(0, TT["vocab"], (2, TT["max_seq"]), generator=torch.Generator().manual_seed(7))
        pos = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        with torch.no_grad():
            logits = ref_model(input_ids, pos, ref_model.get_attention_masks(pos)).float()
        torch.save({"input_ids": input_ids, "logits": logits}, out / "reference" / "logits.pt")


def _torchtitan_qwen3(out: Path, rank: int, input_ids: torch.Tensor) -> None:
    _torchtitan(out, rank, input_ids, family="qwen3")


class _TrainState:
    """A Stateful like torchtitan's trainer's (step counter as bytes in the checkpoint)."""

    def __init__(self, step: int):
        self.step = step

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


WRITERS = {
    "accelerate": _accelerate, "torchtitan": _torchtitan, "torchtitan_qwen3": _torchtitan_qwen3,
    "dcp_plain": _dcp_plain, "dcp_nested": _dcp_nested,
}


def _worker(rank: int, root: str, port: int, only: list[str]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
    )
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(SEED)
    input_ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    try:
        for name in only:
            out = Path(root) / name
            WRITERS[name](out, rank, input_ids)
            dist.barrier()
    finally:
        dist.destroy_process_group()


#: What the ranks import, imported once by the parent before it forks them (examples/fork_ranks.py).
PRELOAD = (
    "accelerate", "transformers", "safetensors.torch", "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp", "torchtitan.components.checkpoint", "torchtitan.components.optimizer",
    "torchtitan.models.llama3", "torchtitan.models.qwen3",
)


def write_all(root: Path, only: list[str] | None = None) -> Path:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _torchtitan_stand_ins()  # before the preload imports torchtitan's models
    method = rank_start_method(PRELOAD)
    mp.start_processes(_worker, args=(str(root), port, only or list(WRITERS)), nprocs=WORLD, join=True, start_method=method)
    (Path(root) / "fixture.json").write_text(json.dumps({"written": only or list(WRITERS), "torch": torch.__version__}))
    return Path(root)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder to write the checkpoints into")
    ap.add_argument("only", nargs="*", help=f"write only these, of {', '.join(sorted(WRITERS))} (default: all)")
    args = ap.parse_args()
    if set(args.only) - set(WRITERS):
        ap.error(f"unknown checkpoints {sorted(set(args.only) - set(WRITERS))}; choose from {sorted(WRITERS)}")
    write_all(args.out, args.only or None)
