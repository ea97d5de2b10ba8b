"""Write the torch-version fixtures: tiny sharded checkpoints as the *running* torch pickles them.

    python make_fixtures.py OUT_ROOT        # writes OUT_ROOT/torch-<version>/

Run it once per torch release, each in its own venv holding only torch and safetensors (no
transformers: the model is plain ``nn.Module``\\ s with Qwen2's parameter names). Two ranks on gloo
(CPU), started with ``torch.multiprocessing.start_processes(..., "spawn")``, write per release:

- ``fsdp1/``     FSDP1 (``FullyShardedDataParallel`` with a 1-D device mesh) under
                 ``SHARDED_STATE_DICT``: DTensor rank files ``model_world_size_2_rank_{r}.pt`` as verl
                 saves them, ``fsdp_config.json``, ``huggingface/config.json`` (qwen2);
- ``fsdp2/``     FSDP2 ``fully_shard`` per layer and root on a ``("fsdp",)`` mesh (``gate/up_proj`` on
                 ``Shard(1)`` where ``shard_placement_fn`` exists, torch >= 2.6), same files;
- ``hsdp_1x2/``  FSDP2 on a ``("replicate", "shard")`` mesh of shape (1, 2);
- ``hsdp_2x1/``  the same on a (2, 1) mesh (every rank a full replica);
- ``dcp/``       ``torch.distributed.checkpoint.save`` of the FSDP2 model's state dict, with
                 ``config.json`` beside ``.metadata``.

Beside them: ``reference.safetensors`` (the unsharded weights every cell holds) and ``VERSIONS``
(torch, python, date, command, and each cell written or skipped with the reason). vocab 37 and
intermediate 21 do not divide by 2, so every cell has uneven chunks. Each rank checks that the
gathered DTensors equal the reference before anything is saved.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import sys
import traceback
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
CFG = {
    "vocab_size": 37, "hidden_size": 16, "intermediate_size": 21, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1,
}
CELLS = ("fsdp1", "fsdp2", "hsdp_1x2", "hsdp_2x1", "dcp")


class Attention(nn.Module):
    def __init__(self, h: int, heads: int, kv: int):
        super().__init__()
        d = h // heads
        self.q_proj = nn.Linear(h, heads * d, bias=True)
        self.k_proj = nn.Linear(h, kv * d, bias=True)
        self.v_proj = nn.Linear(h, kv * d, bias=True)
        self.o_proj = nn.Linear(heads * d, h, bias=False)


class MLP(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class RMSNorm(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))


class DecoderLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h = c["hidden_size"]
        self.self_attn = Attention(h, c["num_attention_heads"], c["num_key_value_heads"])
        self.mlp = MLP(h, c["intermediate_size"])
        self.input_layernorm = RMSNorm(h)
        self.post_attention_layernorm = RMSNorm(h)


class Inner(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"])


class CausalLM(nn.Module):
    """Qwen2ForCausalLM's parameter names and shapes, nothing else."""

    def __init__(self, c: dict):
        super().__init__()
        self.model = Inner(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)


def build_model() -> CausalLM:
    """The same weights on every rank and in every run of one torch (seeded normal values)."""
    model = CausalLM(CFG)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def hf_config() -> dict:
    c = CFG
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **c,
        "head_dim": c["hidden_size"] // c["num_attention_heads"], "hidden_act": "silu",
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": c["num_hidden_layers"],
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor
    return DTensor


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4, 2.5
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _check_and_describe(sd: dict, ref: dict) -> dict:
    """Every rank gathers each DTensor and compares it with the reference (collective)."""
    DTensor = _dtensor_cls()
    placements = {}
    for k in sorted(sd):
        v = sd[k]
        if isinstance(v, DTensor):
            full = v.full_tensor()
            placements[k] = str(tuple(v.placements))
        else:
            full = v
            placements[k] = "plain"
        if not torch.equal(full.cpu(), ref[k]):
            raise AssertionError(f"{k}: the gathered tensor differs from the reference")
    return placements


def _save_rank_files(folder: Path, sd: dict, rank: int, fsdp_version: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(sd, folder / f"model_world_size_{WORLD}_rank_{rank}.pt")
    if rank == 0:
        (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": fsdp_version, "world_size": WORLD}, indent=2))
        (folder / "huggingface").mkdir(exist_ok=True)
        (folder / "huggingface" / "config.json").write_text(json.dumps(hf_config(), indent=2))


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def cell_fsdp1(out: Path, rank: int, ref: dict) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardedStateDictConfig, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(
        build_model(), device_mesh=_mesh((WORLD,), ("fsdp",)), auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}),
        use_orig_params=True, device_id=torch.device("cpu"),
    )
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True)):
        sd = model.state_dict()
    placements = _check_and_describe(sd, ref)
    _save_rank_files(out / "fsdp1", sd, rank, 1)
    return placements


def _fsdp2(mesh, shard1: bool):
    fully_shard = _fully_shard()
    model = build_model()
    kw = {"mesh": mesh}
    note = ""
    if shard1:
        import inspect

        if "shard_placement_fn" in inspect.signature(fully_shard).parameters:
            try:
                from torch.distributed.tensor import Shard
            except ImportError:
                from torch.distributed._tensor import Shard
            # FSDP2 shards dim 1 only evenly: gate/up_proj [21, 16] split their 16 columns
            cols = {id(m.weight) for layer in model.model.layers for m in (layer.mlp.gate_proj, layer.mlp.up_proj)}
            kw["shard_placement_fn"] = lambda p: Shard(1) if id(p) in cols else Shard(0)
        else:
            note = "fully_shard has no shard_placement_fn: all Shard(0)"
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model, note


def cell_fsdp2(out: Path, rank: int, ref: dict) -> dict:
    model, note = _fsdp2(_mesh((WORLD,), ("fsdp",)), shard1=True)
    sd = model.state_dict()
    placements = _check_and_describe(sd, ref)
    _save_rank_files(out / "fsdp2", sd, rank, 2)
    return {**placements, **({"note": note} if note else {})}


def _hsdp(out: Path, rank: int, ref: dict, shape: tuple[int, int], name: str) -> dict:
    model, _ = _fsdp2(_mesh(shape, ("replicate", "shard")), shard1=False)
    sd = model.state_dict()
    placements = _check_and_describe(sd, ref)
    _save_rank_files(out / name, sd, rank, 2)
    return placements


def cell_hsdp_1x2(out: Path, rank: int, ref: dict) -> dict:
    return _hsdp(out, rank, ref, (1, WORLD), "hsdp_1x2")


def cell_hsdp_2x1(out: Path, rank: int, ref: dict) -> dict:
    return _hsdp(out, rank, ref, (WORLD, 1), "hsdp_2x1")


def cell_dcp(out: Path, rank: int, ref: dict) -> dict:
    import torch.distributed.checkpoint as dcp

    model, _ = _fsdp2(_mesh((WORLD,), ("fsdp",)), shard1=True)
    sd = model.state_dict()
    placements = _check_and_describe(sd, ref)
    folder = out / "dcp"
    dcp.save(sd, checkpoint_id=str(folder))
    if rank == 0:
        (folder / "config.json").write_text(json.dumps(hf_config(), indent=2))
    return placements


def _worker(rank: int, out: str, port: int, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    out_p = Path(out)
    ref = build_model().state_dict()
    results = {}
    for cell in CELLS:
        try:
            results[cell] = {"written": True, "placements": globals()[f"cell_{cell}"](out_p, rank, ref)}
        except Exception as e:  # a cell this torch cannot write: recorded, the others go on
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            results[cell] = {"written": False, "why": f"{type(e).__name__}: {first[:300]}"}
            if rank == 0:
                traceback.print_exc()
        dist.barrier()
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_reference(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in build_model().state_dict().items()}, str(path))


def _relative(path: str) -> str:
    """``path`` as seen from the working directory (the repository root), for VERSIONS."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    version = torch.__version__.split("+")[0]
    out = Path(argv[0]) / f"torch-{version}"
    out.mkdir(parents=True, exist_ok=True)
    _save_reference(out / "reference.safetensors")
    result_dir = out / ".results"
    result_dir.mkdir(exist_ok=True)
    mp.start_processes(_worker, args=(str(out), _free_port(), str(result_dir)), nprocs=WORLD, start_method="spawn")
    per_rank = [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in range(WORLD):
        (result_dir / f"rank{r}.json").unlink()
    result_dir.rmdir()
    lines = [
        f"torch {torch.__version__}",
        f"python {platform.python_version()}",
        f"date {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"command python {_relative(sys.argv[0])} {_relative(argv[0])}  (2 ranks, gloo, CPU, spawn)",
    ]
    for cell in CELLS:
        a, b = per_rank[0][cell], per_rank[1][cell]
        if a["written"] and b["written"]:
            note = a["placements"].pop("note", "")
            kinds = sorted(set(a["placements"].values()))
            lines.append(f"{cell} written: {'; '.join(kinds)}" + (f" ({note})" if note else ""))
        else:
            lines.append(f"{cell} skipped: {(a if not a['written'] else b).get('why')}")
            shutil.rmtree(out / cell, ignore_errors=True)  # whatever a failed cell left
    (out / "VERSIONS").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
