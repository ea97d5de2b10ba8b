"""Write REAL verl-style FSDP checkpoints on CPU, with reference outputs, for tests and demos.

Every rank file is produced by real ``torch.distributed`` processes (gloo backend, one process
per rank, started with ``torch.multiprocessing.start_processes``): either a model wrapped with
FSDP2 ``fully_shard`` whose ``state_dict()`` is saved as verl does, or real DTensors made with
``torch.distributed.tensor.distribute_tensor`` for chosen layouts (HSDP, uneven/empty chunks,
Shard(1), world size 1, plain buffers; each also available through ``fully_shard``). Nothing is
hand-assembled; rank 0 checks that the gathered shards equal the unsharded reference bit for bit
and that the FSDP2 forward reproduces the reference logits.

Layout written under ``root`` (verl's)::

    root/latest_checkpointed_iteration.txt           "<step>"
    root/global_step_<step>/actor/model_world_size_<N>_rank_<r>.pt
    root/global_step_<step>/actor/fsdp_config.json   {"FSDP_version": 2, "world_size": N}
    root/global_step_<step>/actor/lora_train_meta.json  (LoRA runs, unless lora_meta=False)
    root/global_step_<step>/actor/huggingface/       config.json (dtype = config_dtype),
                                                     generation_config.json, tokenizer files
    root/reference/                                  save_pretrained of the UNSHARDED model in
                                                     the training dtype (LoRA: merge_and_unload())
    root/reference/logits.pt                         {"input_ids": [2, 8], "logits": float32}
    root/reference/adapter/, root/reference/base/    LoRA runs: PEFT adapter, base before LoRA
    root/base_model/                                 save_lora_only runs: base model for --base-model
    root/fixture.json                                what was written (options, placements, timings)

Use as a module (``write_fsdp_checkpoint``, ``write_dtensor_checkpoint``) or as a script::

    python examples/make_fsdp_checkpoint.py OUT --arch qwen2 --world-size 2
    python examples/make_fsdp_checkpoint.py OUT --layout hsdp

Speed: every rank process needs torch + transformers (+ peft) imported, ~4-5 s each on a small
machine. By default processes are started with the ``forkserver`` method and the fork server
pre-imports those libraries once per parent process, so after the first checkpoint each further
one costs about a second. ``start_method="spawn"`` (or ``HF_MERGE_FIXTURE_START_METHOD=spawn``)
gives plain, slower ``torch.multiprocessing.spawn`` behaviour.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

# The name the workers are pickled under. When this file runs as a script, ``__main__`` re-imports
# it under this name (see the bottom) so that the fork server can pre-import it.
MODULE_NAME = "make_fsdp_checkpoint"

# Whether FSDP2 can run a forward on CPU: torch 2.6's unshard records an event on a torch.cpu.Stream,
# which has no record_event there. Without it the checkpoint is written all the same (saving reads
# the local shards, no unshard); only the check that the FSDP2 forward reproduces the reference
# logits is left out, and the fixture records its difference as null.
FSDP2_CPU_FORWARD = hasattr(torch.cpu.Stream, "record_event")

# Modules the fork server imports once, so that each rank process starts warm.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "tokenizers",
    "peft",
    MODULE_NAME,
]

LORA_DEFAULT = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "use_rslora": False,
    "modules_to_save": None,
}

LAYOUTS = ("hsdp", "uneven", "shard1", "ws1", "mixed_buffers")

# A small fixed word list: the corpus the offline tokenizer is trained on.
_WORDS = (
    "the of and to in is it that was for on are with as be at by this have from or one had not "
    "but what all were when we there can an your which their said if do will each about how up "
    "out them then she many some so these would other into has more her two like him see time "
    "could no make than first been its who now people my made over did down only way find use "
    "may water long little very after words called just where most know get through back much "
    "before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such"
).split()


# --------------------------------------------------------------------------------------------
# Result description
# --------------------------------------------------------------------------------------------


@dataclass
class FsdpCheckpoint:
    """Paths of one written checkpoint, plus what is in it."""

    root: Path
    step: int
    world_size: int
    actor: Path  # root/global_step_<step>/actor
    hf_dir: Path  # actor/huggingface
    reference: Path  # root/reference (HF folder, training dtype)
    logits: Path  # root/reference/logits.pt
    rank_files: list[Path]
    reference_adapter: Path | None = None  # LoRA: PEFT adapter folder
    reference_base: Path | None = None  # LoRA: base model before LoRA
    base_model: Path | None = None  # save_lora_only: base model for --base-model
    options: dict[str, Any] = field(default_factory=dict)
    placements: dict[str, str] = field(default_factory=dict)  # key -> "Shard(dim=0)" etc. / "plain"
    seconds: float = 0.0

    @property
    def step_dir(self) -> Path:
        return self.actor.parent

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()} | {
            "rank_files": [str(p) for p in self.rank_files]
        }


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def write_fsdp_checkpoint(
    root: str | os.PathLike,
    *,
    arch: str = "qwen2",
    tie_word_embeddings: bool = False,
    train_dtype: str = "float32",
    config_dtype: str = "bfloat16",
    world_size: int = 2,
    step: int = 1,
    seed: int = 0,
    lora: dict[str, Any] | None = None,
    lora_meta: bool = True,
    save_lora_only: bool = False,
    shard_placement: str | None = None,
    vocab_size: int | None = None,
    start_method: str | None = None,
) -> FsdpCheckpoint:
    """Train-free verl FSDP2 checkpoint: a tiny seeded model, ``fully_shard`` per decoder layer
    then the root, on a 1-D ``("fsdp",)`` mesh; each rank saves ``model.state_dict()``.

    ``shard_placement="first_divisible"`` passes verl's ``shard_placement_fn`` (shard the first dim
    divisible by the world size, else dim 0); the default vocab is then made indivisible by the
    world size so that ``Shard(1)`` occurs on the embedding / lm_head.
    ``lora`` (a dict like :data:`LORA_DEFAULT`, missing keys filled from it) wraps the model with
    PEFT (``init_lora_weights=False``, so B != 0) before sharding.
    """
    if shard_placement not in (None, "first_divisible"):
        raise ValueError(f"shard_placement must be None or 'first_divisible', not {shard_placement!r}")
    if save_lora_only and not lora:
        raise ValueError("save_lora_only=True needs lora=...")
    if vocab_size is None:
        vocab_size = 128
        if shard_placement == "first_divisible" and world_size > 1:
            vocab_size = next(v for v in range(129, 1000) if v % world_size)
    spec = dict(
        kind="fsdp2",
        layout="fsdp2",
        arch=arch,
        tie_word_embeddings=tie_word_embeddings,
        train_dtype=train_dtype,
        config_dtype=config_dtype,
        world_size=world_size,
        mesh_shape=[world_size],
        mesh_dim_names=["fsdp"],
        step=step,
        seed=seed,
        lora=_full_lora(lora),
        lora_meta=lora_meta,
        save_lora_only=save_lora_only,
        shard_placement=shard_placement,
        config_overrides={"vocab_size": vocab_size},
        persistent_buffers=False,
    )
    return _run(root, spec, start_method)


def write_dtensor_checkpoint(
    root: str | os.PathLike,
    *,
    layout: str,
    arch: str = "qwen2",
    tie_word_embeddings: bool = False,
    train_dtype: str = "float32",
    config_dtype: str = "bfloat16",
    world_size: int | None = None,
    step: int = 1,
    seed: int = 0,
    method: str = "distribute_tensor",
    start_method: str | None = None,
) -> FsdpCheckpoint:
    """verl-layout checkpoint whose rank files hold DTensors made with ``distribute_tensor``
    (``method="distribute_tensor"``, the default) or by FSDP2 itself (``method="fully_shard"``:
    ``fully_shard`` per decoder layer and root on the layout's mesh, with a ``shard_placement_fn``
    giving the same placements; at world size 1 this gives DTensors on a 1-rank mesh).

    layouts:
      ``hsdp``          world size 4, mesh ("ddp", "fsdp") of shape (2, 2), (Replicate(), Shard(0))
      ``uneven``        world size 4, a deliberately odd tiny model (vocab 10, hidden 6, head_dim 2,
                        one kv head) so that Shard(0) chunks are short and some are EMPTY
      ``shard1``        world size 2, Shard(1) on o_proj / down_proj / embed_tokens, Shard(0) else
      ``ws1``           world size 1, plain tensors (no DTensor), as verl saves at world size 1
      ``mixed_buffers`` world size 2, Shard(0) DTensors plus a persistent buffer
                        (``model.rotary_emb.inv_freq``) saved as a plain tensor in every rank file
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    if method not in ("distribute_tensor", "fully_shard"):
        raise ValueError(f"method must be 'distribute_tensor' or 'fully_shard', not {method!r}")
    default_ws = {"hsdp": 4, "uneven": 4, "shard1": 2, "ws1": 1, "mixed_buffers": 2}[layout]
    world_size = world_size or default_ws
    overrides: dict[str, Any] = {}
    mesh_shape, names = [world_size], ["fsdp"]
    if layout == "hsdp":
        if world_size % 2:
            raise ValueError("hsdp needs an even world size")
        mesh_shape, names = [2, world_size // 2], ["ddp", "fsdp"]
    elif layout == "uneven":
        overrides = dict(
            vocab_size=10,
            hidden_size=6,
            intermediate_size=10,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=2,
        )
    elif layout == "ws1" and world_size != 1:
        raise ValueError("layout 'ws1' is world size 1")
    spec = dict(
        kind="fsdp2" if method == "fully_shard" else ("plain" if layout == "ws1" else "dtensor"),
        layout=layout,
        arch=arch,
        tie_word_embeddings=tie_word_embeddings,
        train_dtype=train_dtype,
        config_dtype=config_dtype,
        world_size=world_size,
        mesh_shape=mesh_shape,
        mesh_dim_names=names,
        step=step,
        seed=seed,
        lora=None,
        lora_meta=False,
        save_lora_only=False,
        shard_placement="shard1_some" if layout == "shard1" else None,
        config_overrides=overrides,
        persistent_buffers=layout == "mixed_buffers",
    )
    return _run(root, spec, start_method)


# --------------------------------------------------------------------------------------------
# Process management
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full_lora(lora: dict[str, Any] | None) -> dict[str, Any] | None:
    if not lora:
        return None
    unknown = set(lora) - set(LORA_DEFAULT)
    if unknown:
        raise ValueError(f"unknown LoRA options {sorted(unknown)}; known: {sorted(LORA_DEFAULT)}")
    return {**LORA_DEFAULT, **lora}


def _start_method(requested: str | None) -> str:
    method = requested or os.environ.get("HF_MERGE_FIXTURE_START_METHOD") or "forkserver"
    if method == "forkserver":
        import multiprocessing as mp

        if "forkserver" not in mp.get_all_start_methods():
            return "spawn"
        # Only effective before the fork server starts (the first forkserver use in a process).
        # The fork server imports this module by MODULE_NAME: its folder must be on sys.path
        # (``_run`` puts it there before the first process starts).
        mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return method


def _run(root: str | os.PathLike, spec: dict[str, Any], start_method: str | None) -> FsdpCheckpoint:
    import torch.multiprocessing as tmp

    t0 = time.perf_counter()
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, root=str(root))
    # never leave rank files of an earlier run (another world size) next to the new ones
    actor = root / f"global_step_{spec['step']}" / "actor"
    for stale in [*actor.glob("model_world_size_*_rank_*.pt"), root / "fixture.json"]:
        stale.unlink(missing_ok=True)
    method = _start_method(start_method)
    # Pickle the worker by its importable module name (never as __main__._worker), whatever name
    # this file was imported under.
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    worker = __import__(MODULE_NAME)._worker
    last_err: Exception | None = None
    for _attempt in range(3):  # a picked port can be taken before the store binds it
        spec["port"] = _free_port()
        try:
            tmp.start_processes(worker, args=(spec,), nprocs=spec["world_size"], join=True, start_method=method)
            last_err = None
            break
        except Exception as e:  # noqa: BLE001 - re-raised below unless it was a port clash
            last_err = e
            if "address already in use" not in str(e).lower():
                raise
    if last_err is not None:
        raise last_err
    info = json.loads((root / "fixture.json").read_text())
    seconds = time.perf_counter() - t0
    info["seconds"] = round(seconds, 3)
    info["start_method"] = method
    (root / "fixture.json").write_text(json.dumps(info, indent=2))
    return _describe(root, info)


def _describe(root: Path, info: dict[str, Any]) -> FsdpCheckpoint:
    opt = info["options"]
    step, ws = opt["step"], opt["world_size"]
    actor = root / f"global_step_{step}" / "actor"
    lora = bool(opt.get("lora"))
    return FsdpCheckpoint(
        root=root,
        step=step,
        world_size=ws,
        actor=actor,
        hf_dir=actor / "huggingface",
        reference=root / "reference",
        logits=root / "reference" / "logits.pt",
        rank_files=[actor / f"model_world_size_{ws}_rank_{r}.pt" for r in range(ws)],
        reference_adapter=root / "reference" / "adapter" if lora else None,
        reference_base=root / "reference" / "base" if lora else None,
        base_model=root / "base_model" if opt.get("save_lora_only") else None,
        options=opt,
        placements=info.get("placements", {}),
        seconds=info.get("seconds", 0.0),
    )


def load_checkpoint_info(root: str | os.PathLike) -> FsdpCheckpoint:
    """Describe a checkpoint written earlier (reads ``root/fixture.json``)."""
    root = Path(root).resolve()
    return _describe(root, json.loads((root / "fixture.json").read_text()))


# --------------------------------------------------------------------------------------------
# Model, tokenizer, config (run inside the rank processes)
# --------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hf_config(spec: dict[str, Any]):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec["tie_word_embeddings"],
        bos_token_id=0,  # <|endoftext|>
        eos_token_id=2,  # <|im_end|>
        pad_token_id=0,
    )
    common.update(spec["config_overrides"])
    if spec["arch"] == "qwen2":
        cfg = Qwen2Config(**common)
    elif spec["arch"] == "llama":
        cfg = LlamaConfig(**common)
    else:
        raise ValueError(f"arch must be 'qwen2' or 'llama', not {spec['arch']!r}")
    return cfg


def _tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (Qwen2/GPT-2 style) trained OFFLINE on a fixed word list, with
    n = min(vocab_size, 100) ids. Byte-level because transformers 5's AutoTokenizer rebuilds a
    qwen2 checkpoint's tokenizer as ``Qwen2Tokenizer`` (byte-level BPE) from vocab + merges,
    whatever ``tokenizer_class`` says. Training is deterministic (checked: same JSON twice)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n = min(vocab_size, 100)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if n >= 48:
        words = list(dict.fromkeys(_WORDS))
        corpus = [" ".join(words[i : i + 8]) for i in range(0, len(words), 8)] * 3
    else:  # tiny vocab (the "uneven" layout): a three-symbol alphabet a, b, space
        corpus = ["a b ab ba abba baab aab bba"] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n, special_tokens=specials, initial_alphabet=[], show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size, (tok.get_vocab_size(), vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=256,
    )


def _input_ids(vocab: int) -> torch.Tensor:
    """Fixed [2, 8] ids (no RNG), below min(vocab, tokenizer vocab)."""
    n = min(vocab, 100)
    return ((torch.arange(16, dtype=torch.long) * 7 + 3) % n).view(2, 8)


def _build_model(spec: dict[str, Any], save_base_to: list[Path] | None = None):
    """The same seeded model on every call: base (randomised so that every element, norms and
    biases included, is distinct), cast to the training dtype, optionally wrapped with LoRA."""
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(spec)
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(cfg)
    # -> adapter_config.json base_model_name_or_path (reference/adapter)
    model.config._name_or_path = model.name_or_path = f"tiny/{spec['arch']}-base"
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    with torch.no_grad():
        for _name, p in model.named_parameters():  # tied weights appear once here
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    if spec["persistent_buffers"]:
        # Old Llama-era checkpoints persisted rotary inv_freq; FSDP2 / verl save such buffers as
        # plain tensors, a full copy in every rank file.
        for mod in model.modules():
            if "inv_freq" in getattr(mod, "_buffers", {}):
                buf = mod._buffers["inv_freq"]
                mod.register_buffer("inv_freq", buf, persistent=True)
    # Cast parameters only: buffers (rotary inv_freq) stay float32, as from_pretrained(dtype=...)
    # leaves them; ``model.to(bf16)`` would round inv_freq and shift the logits by ~1 bf16 ulp.
    dtype = _DTYPES[spec["train_dtype"]]
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
    model.eval()
    for d in save_base_to or []:
        model.save_pretrained(d)
    lora = spec["lora"]
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(spec["seed"] + 2)
        lcfg = LoraConfig(
            r=lora["r"],
            lora_alpha=lora["lora_alpha"],
            target_modules=list(lora["target_modules"]),
            use_rslora=lora["use_rslora"],
            modules_to_save=lora["modules_to_save"],
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
            init_lora_weights=False,
        )
        model = get_peft_model(model, lcfg)
        g = torch.Generator().manual_seed(spec["seed"] + 3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".modules_to_save." in name:  # "trained" copy differs from the original
                    p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
        model.eval()
    return model


def _decoder_layers(model) -> list[torch.nn.Module]:
    from transformers import PreTrainedModel

    base = model
    if hasattr(model, "get_base_model"):
        base = model.get_base_model()
    assert isinstance(base, PreTrainedModel)
    return list(base.model.layers)


def _placement_str(v: Any) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return "(" + ", ".join(repr(p) for p in v.placements) + ")"
    return "plain"


def _is_lora_key(k: str) -> bool:
    return ".lora_A." in k or ".lora_B." in k or ".modules_to_save." in k


def _write_side_files(spec: dict[str, Any], cfg, tokenizer) -> None:
    root = Path(spec["root"])
    ws, step = spec["world_size"], spec["step"]
    actor = root / f"global_step_{step}" / "actor"
    hf = actor / "huggingface"
    hf.mkdir(parents=True, exist_ok=True)
    from transformers import GenerationConfig

    cfg_out = cfg.__class__.from_dict(cfg.to_dict())
    cfg_out.dtype = spec["config_dtype"]
    cfg_out.save_pretrained(hf)
    cj = json.loads((hf / "config.json").read_text())
    cj["_name_or_path"] = f"tiny/{spec['arch']}-base"
    cj["dtype"] = spec["config_dtype"]
    cj["architectures"] = [{"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[spec["arch"]]]
    (hf / "config.json").write_text(json.dumps(cj, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    ).save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": ws}, indent=4))
    if spec["lora"] and spec["lora_meta"]:
        meta = {"r": spec["lora"]["r"], "lora_alpha": spec["lora"]["lora_alpha"], "task_type": "CAUSAL_LM"}
        (actor / "lora_train_meta.json").write_text(json.dumps(meta, indent=4))
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))


# --------------------------------------------------------------------------------------------
# The rank process
# --------------------------------------------------------------------------------------------


def _worker(rank: int, spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # peft/transformers deprecations
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(spec["port"])
    ws = spec["world_size"]
    dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=timedelta(seconds=120))
    try:
        _worker_body(rank, spec)
    finally:
        dist.destroy_process_group()


def _shard_dim(name: str, shape: tuple[int, ...], rule: str | None, ws: int) -> int:
    """Which dim the "fsdp" mesh dim shards, for a parameter of this name and shape."""
    if rule == "first_divisible":  # verl's get_shard_placement_fn
        for i, n in enumerate(shape):
            if n % ws == 0:
                return i
        return 0
    if rule == "shard1_some" and len(shape) == 2 and any(s in name for s in ("o_proj", "down_proj", "embed_tokens")):
        return 1
    return 0


def _worker_body(rank: int, spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    t0 = time.perf_counter()
    root = Path(spec["root"])
    ws, step, kind, layout = spec["world_size"], spec["step"], spec["kind"], spec["layout"]
    actor = root / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True, exist_ok=True)
    ref_dir = root / "reference"

    # ---- rank 0: the unsharded reference (same seed => identical values) ------------------
    ref = None
    if rank == 0:
        save_base: list[Path] = []
        if spec["lora"]:
            save_base.append(ref_dir / "base")
            if spec["save_lora_only"]:
                save_base.append(root / "base_model")
        ref = _build_model(spec, save_base_to=save_base)
        ref_sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    model = _build_model(spec)

    # ---- shard ----------------------------------------------------------------------------
    mesh = None
    if kind != "plain":
        mesh = init_device_mesh("cpu", tuple(spec["mesh_shape"]), mesh_dim_names=tuple(spec["mesh_dim_names"]))
    rule, fsdp_size = spec["shard_placement"], spec["mesh_shape"][-1]
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        kw: dict[str, Any] = {"mesh": mesh}
        if rule is not None:
            names = {id(p): n for n, p in model.named_parameters()}

            def shard_placement_fn(param):
                return Shard(_shard_dim(names[id(param)], tuple(param.shape), rule, fsdp_size))

            kw["shard_placement_fn"] = shard_placement_fn
        for layer in _decoder_layers(model):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        sd = model.state_dict()
    elif kind == "dtensor":
        params = dict(model.named_parameters(remove_duplicate=False))
        sd = {}
        for k, v in model.state_dict().items():
            if k not in params:  # buffer: a plain full copy on every rank, as FSDP2 saves it
                sd[k] = v
                continue
            shard = Shard(_shard_dim(k, tuple(v.shape), rule, fsdp_size))
            placements = [Replicate(), shard] if len(spec["mesh_shape"]) == 2 else [shard]
            sd[k] = distribute_tensor(v.detach(), mesh, placements)
    else:  # plain, world size 1
        sd = model.state_dict()

    if spec["save_lora_only"]:
        sd = {k: v for k, v in sd.items() if _is_lora_key(k)}

    # ---- save the rank file (exactly what verl does) ------------------------------------------
    torch.save(sd, actor / f"model_world_size_{ws}_rank_{rank}.pt")

    # ---- check: the gathered shards equal the reference, bit for bit (collective) -------------
    mismatches = []
    for k, v in sd.items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if rank == 0 and not torch.equal(full, ref_sd[k]):
            mismatches.append(k)
    # FSDP2 forward must reproduce the reference logits (collective: every rank runs it).
    ids = _input_ids(_hf_config(spec).vocab_size)
    fsdp_logits = None
    if kind == "fsdp2" and FSDP2_CPU_FORWARD:
        with torch.no_grad():
            fsdp_logits = model(input_ids=ids).logits.float()
    dist.barrier()
    if rank != 0:
        return

    if mismatches:
        raise RuntimeError(f"gathered shards differ from the reference model: {mismatches[:5]}")

    # ---- rank 0: reference outputs and the side files -------------------------------------------
    cfg = _hf_config(spec)
    tokenizer = _tokenizer(cfg.vocab_size)
    _write_side_files(spec, cfg, tokenizer)
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits.float()
    fsdp_diff = None
    if fsdp_logits is not None:
        fsdp_diff = (fsdp_logits - ref_logits).abs().max().item()
        if fsdp_diff > (1e-5 if spec["train_dtype"] == "float32" else 5e-2):
            raise RuntimeError(f"FSDP2 forward differs from the unsharded reference by {fsdp_diff}")
    ref_dir.mkdir(parents=True, exist_ok=True)
    if spec["lora"]:
        ref.save_pretrained(ref_dir / "adapter")
        merged = ref.merge_and_unload()
        merged.save_pretrained(ref_dir)
    else:
        ref.save_pretrained(ref_dir)
    tokenizer.save_pretrained(ref_dir)
    if spec["save_lora_only"]:
        tokenizer.save_pretrained(root / "base_model")
    torch.save({"input_ids": ids, "logits": ref_logits}, ref_dir / "logits.pt")

    options = {k: v for k, v in spec.items() if k not in ("root", "port")}
    info = {
        "options": options,
        "placements": {k: _placement_str(v) for k, v in sd.items()},
        "local_shapes_rank0": {k: list((v.to_local() if isinstance(v, DTensor) else v).shape) for k, v in sd.items()},
        "global_shapes": {k: list(v.shape) for k, v in sd.items()},
        "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in sd.items()},
        "fsdp_forward_max_abs_diff": fsdp_diff,
        "rank0_seconds": round(time.perf_counter() - t0, 3),
    }
    (root / "fixture.json").write_text(json.dumps(info, indent=2))


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="checkpoint root folder (global_step_<i>/ goes inside)")
    p.add_argument("--layout", choices=LAYOUTS, help="write_dtensor_checkpoint layout instead of FSDP2")
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--train-dtype", default="float32", choices=list(_DTYPES))
    p.add_argument("--config-dtype", default="bfloat16", choices=list(_DTYPES))
    p.add_argument("--step", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-placement", choices=["first_divisible"], default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--lora-r", type=int, default=None, help="enable LoRA with this rank")
    p.add_argument("--lora-alpha", type=int, default=None)
    p.add_argument("--lora-targets", default=None, help="comma-separated target modules")
    p.add_argument("--rslora", action="store_true")
    p.add_argument("--modules-to-save", default=None, help="comma-separated")
    p.add_argument("--no-lora-meta", action="store_true")
    p.add_argument("--save-lora-only", action="store_true")
    p.add_argument("--start-method", choices=["forkserver", "spawn"], default=None)
    a = p.parse_args(argv)
    common = dict(
        arch=a.arch,
        tie_word_embeddings=a.tie_word_embeddings,
        train_dtype=a.train_dtype,
        config_dtype=a.config_dtype,
        step=a.step,
        seed=a.seed,
        start_method=a.start_method,
    )
    if a.layout:
        ck = write_dtensor_checkpoint(a.out, layout=a.layout, world_size=a.world_size, **common)
    else:
        lora = None
        if a.lora_r or a.lora_targets or a.rslora or a.modules_to_save or a.save_lora_only:
            lora = {"r": a.lora_r or LORA_DEFAULT["r"], "use_rslora": a.rslora}
            lora["lora_alpha"] = a.lora_alpha or 2 * lora["r"]
            if a.lora_targets:
                lora["target_modules"] = a.lora_targets.split(",")
            if a.modules_to_save:
                lora["modules_to_save"] = a.modules_to_save.split(",")
        ck = write_fsdp_checkpoint(
            a.out,
            world_size=a.world_size or 2,
            lora=lora,
            lora_meta=not a.no_lora_meta,
            save_lora_only=a.save_lora_only,
            shard_placement=a.shard_placement,
            vocab_size=a.vocab_size,
            **common,
        )
    out = ck.to_json()
    out.pop("placements")
    print(json.dumps(out, indent=2))
    print(f"wrote {ck.actor} in {ck.seconds:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # Re-import this file under its module name so workers pickle as make_fsdp_checkpoint._worker
    # (importable by the fork server / spawned children), then run its main().
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_fsdp_checkpoint as _self

    sys.exit(_self.main())
