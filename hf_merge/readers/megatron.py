"""verl Megatron checkpoints, read as a lazy checkpoint of Hugging Face tensors.

No Megatron import, no process group, nothing read until a tensor is asked for.

Layouts (``info.details["layout"]``):

- ``"v1"``: ``<role>/dist_ckpt/`` (model, and in old verl also ``optimizer.*`` and ``rng_state``
  entries) + ``<role>/huggingface/`` (config, tokenizer) + ``transformer_config.json``.
- ``"v2"``: ``<role>/ckpt_contents.json`` manifest, ``model/dist_ckpt/``, ``model/huggingface/``,
  ``optimizer/dist_ckpt/``, ``extra/dist_ckpt/``.
- ``"mbridge"``: a v1/v2 folder whose ``huggingface/`` already holds the HF weights and whose
  ``dist_ckpt`` holds no model tensors (verl's mbridge default). Nothing to merge: the HF weights
  are served as they are (:class:`~hf_merge.readers.hf_dir.HfDirCheckpoint`), and ``info.notes``
  says so.
- ``"legacy"``: ``model/mp_rank_XX[_PPP]/model.pt`` per-rank ``torch.save`` files (one
  ``GPTModel.state_dict()`` per virtual pipeline stage). TP shards are put back together along
  the dims Megatron splits them on (``_TENSOR_PARALLEL``), PP stages by their layer offsets.
- ``"dist_ckpt"``: a bare ``torch_dist`` folder outside a verl layout (``config_dir`` required).

Names (the contract): the reader yields Megatron-Core's own names and layouts, read with no
renaming: the ``torch_dist`` entries as the folder's ``.metadata`` lists them, through
:class:`~hf_merge.readers.dcp.DcpCheckpoint` (per-layer tensors with a leading layer axis,
``decoder.layers.self_attention.linear_qkv.weight`` ``[L, (nq+2nkv)*hd, H]``, or one key per layer,
``decoder.layers.<i>.…``, when saved with ``singleton_local_shards``), and the legacy rank files as
the model's ``state_dict()`` (``decoder.layers.<i>.…`` with global layer numbers: the only layout
work the reader does is joining TP shards and placing PP / virtual stages). Everything else is the
family's name table (:mod:`hf_merge.name_tables.megatron_gpt`, :mod:`hf_merge.name_tables.megatron_moe`)
applied by the one interpreter, :class:`~hf_merge.transforms.name_table.NameTableView`: stacked layer
and expert axes unstacked, fused QKV and gate/up tensors split by role (lazily, as row regions),
1:1 renames, and a tensor the table does not know is a :class:`~hf_merge.errors.MappingError`
naming it. The reader adds what only the checkpoint's structure says: critic or actor, a tied
output layer, layers that all hold the same tensors. ``open_megatron(...).base`` is the checkpoint
under its Megatron names; ``hf-merge inspect --tensors`` shows the source of every HF tensor.

Critic / value model: a ``[1, H]`` output layer (or ``is_value_model=True``) is written as
``score.weight`` of ``<Family>ForTokenClassification`` with ``num_labels=1``; the config changes
the writer must apply are in ``info.config_overrides`` (a :class:`~hf_merge.config_overrides.ConfigOverrides`),
which also carries
``tie_word_embeddings`` when the checkpoint's structure disagrees with config.json.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..filemap import MappedFile, source_of
from . import contained, record_crc
from ..checkpoint import CheckpointInfo, LazyCheckpoint, check_out
from .. import config_fields
from ..config_overrides import ConfigOverrides
from ..errors import (
    CorruptCheckpointError,
    MappingError,
    MissingConfigError,
    SourceNotFoundError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from ..formats import SourceFormat
from ..spec import TensorSpec
from ..name_tables.megatron_gpt import HF_LAYER, LAYER, NOT_MODEL
from ..transforms.name_table import NameTable, NameTableView, attention_heads, find_table
from .dcp import DcpCheckpoint, is_dcp_dir
from .fsdp_files import choose_step
from ..hf_files import checkpoint_side_dir, load_config
from .safe_pickle import TENSOR_FILE, Allowlist, torch_load

__all__ = ["probe", "open_megatron", "find_layout", "resolve_megatron_dir"]

MANIFEST = "ckpt_contents.json"
TRANSFORMER_CONFIG = "transformer_config.json"
_MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_MAX_NAMED = 12
# Megatron-Core's own names for the tensors whose role the reader decides (not a mapping: the
# checkpoint's structure says whether the output layer is a language-model or a value head, tied
# or not). The HF names come from the family's table (hf_merge.name_tables.megatron_*).
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
OUTPUT_BIAS = "output_layer.bias"
# How legacy per-rank files split a tensor over TP ranks: the dim, or "gate_up" (each rank holds
# [gate_r; up_r]); unlisted names are replicated. A data layout, the same for every family.
_TENSOR_PARALLEL: dict[str, int | str] = {
    EMBEDDING: 0,
    OUTPUT_LAYER: 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "self_attention.linear_proj.bias": 0,
    "mlp.linear_fc1.weight": "gate_up",
    "mlp.linear_fc1.bias": "gate_up",
    "mlp.linear_fc2.weight": 1,
}


# --------------------------------------------------------------------------------------------
# Layout detection
# --------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """Where the parts of a verl Megatron checkpoint are."""

    kind: str  # "v1" | "v2" | "legacy" | "dist_ckpt" (mbridge is decided once the contents are known)
    root: Path
    dist_dir: Path | None = None
    hf_dir: Path | None = None
    legacy_dir: Path | None = None
    manifest: dict[str, Any] | None = None
    transformer_config: dict[str, Any] | None = None
    extra_dist_dirs: list[Path] = field(default_factory=list)


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(contained.check(path).read_bytes())
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptCheckpointError(f"{path}: unreadable {what} ({str(e)[:120]})") from None
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{path}: {what} is not a JSON object")
    return data


def _check_manifest(manifest: dict[str, Any], where: Path) -> None:
    """The manifest's shape: ``contents`` an object of objects whose ``path``/``format`` are strings."""
    contents = manifest.get("contents")
    bad = None
    if contents is not None and not isinstance(contents, dict):
        bad = '"contents" is not an object'
    for key, entry in (contents.items() if isinstance(contents, dict) else ()):
        if entry is not None and not isinstance(entry, dict):
            bad = f'"contents.{str(key)[:40]}" is not an object'
        elif entry and any(entry.get(f) is not None and not isinstance(entry.get(f), str) for f in ("path", "format")):
            bad = f'"contents.{str(key)[:40]}" has a path or format that is not a string'
    if manifest.get("framework") is not None and not isinstance(manifest.get("framework"), str):
        bad = '"framework" is not a string'
    if bad:
        raise CorruptCheckpointError(f"{where}: {bad}; fix the manifest or remove it (the layout is then read from the folders)")


def _safe_rel(root: Path, rel: Any, what: str) -> Path:
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise UnsafeCheckpointError(f"{root / MANIFEST}: {what} path {rel!r} is not a relative path inside the checkpoint")
    return root / rel


def _is_torch_dist(path: Path) -> bool:
    md = path / "metadata.json"
    if not (md.is_file() and is_dcp_dir(path)):
        return False
    try:
        return json.loads(contained.check(md).read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def _has_dist(path: Path) -> bool:
    return path.is_dir() and (is_dcp_dir(path) or (path / "metadata.json").is_file())


def _legacy_dir(root: Path) -> Path | None:
    for cand in (root / "model", root):
        if cand.is_dir() and any(_MP_RANK.match(p.name) and (p / "model.pt").is_file() for p in cand.iterdir()):
            return cand
    return None


def find_layout(path: Path) -> Layout | None:
    """Recognise a verl Megatron checkpoint at ``path`` (cheap: file names and small JSON only)."""
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / MANIFEST).is_file():
        manifest = _read_json(path / MANIFEST, "checkpoint manifest")
        _check_manifest(manifest, path / MANIFEST)
        if manifest.get("framework", "megatron") != "megatron":
            return None
        contents = manifest.get("contents") or {}
        model = contents.get("model") or {}
        lay = Layout("v2", path, manifest=manifest)
        if model.get("format") == "megatron_dist_checkpoint":
            lay.dist_dir = _safe_rel(path, model.get("path"), "model")
        elif (path / "model" / "dist_ckpt").is_dir():
            lay.dist_dir = path / "model" / "dist_ckpt"
        hf_entry = contents.get("hf_config") or (model if model.get("format") == "huggingface" else {})
        lay.hf_dir = _safe_rel(path, hf_entry["path"], "hf_config") if hf_entry.get("path") else path / "model" / "huggingface"
        for key in ("optimizer", "rng_state"):
            entry = contents.get(key) or {}
            if entry.get("path"):
                lay.extra_dist_dirs.append(_safe_rel(path, entry["path"], key))
        tc = contents.get("transformer_config") or {}
        tc_path = _safe_rel(path, tc["path"], "transformer_config") if tc.get("path") else path / TRANSFORMER_CONFIG
        lay.transformer_config = _read_json(tc_path, TRANSFORMER_CONFIG) if tc_path.is_file() else None
        return lay
    if _has_dist(path / "model" / "dist_ckpt") or (
        (path / "model" / "huggingface").is_dir()
        and (_has_dist(path / "optimizer" / "dist_ckpt") or _has_dist(path / "extra" / "dist_ckpt"))
    ):
        lay = Layout("v2", path, hf_dir=path / "model" / "huggingface")
        if (path / "model" / "dist_ckpt").is_dir():
            lay.dist_dir = path / "model" / "dist_ckpt"
        lay.extra_dist_dirs = [p for p in (path / "optimizer" / "dist_ckpt", path / "extra" / "dist_ckpt") if p.is_dir()]
    elif _has_dist(path / "dist_ckpt"):
        lay = Layout("v1", path, dist_dir=path / "dist_ckpt", hf_dir=path / "huggingface")
    elif (legacy := _legacy_dir(path)) is not None:
        hf = path / "huggingface"
        if legacy == path and path.name == "model" and not hf.is_dir():
            hf = path.parent / "huggingface"  # the user passed <role>/model itself
        lay = Layout("legacy", path, legacy_dir=legacy, hf_dir=hf)
    elif _is_torch_dist(path):
        # A dist_ckpt folder itself: use its verl parent when there is one.
        if path.name == "dist_ckpt":
            parent = path.parent.parent if path.parent.name == "model" else path.parent
            found = find_layout(parent)
            if found is not None and found.dist_dir is not None and found.dist_dir.resolve() == path.resolve():
                return found
        return Layout("dist_ckpt", path, dist_dir=path)
    else:
        return None
    if lay.transformer_config is None and (path / TRANSFORMER_CONFIG).is_file():
        lay.transformer_config = _read_json(path / TRANSFORMER_CONFIG, TRANSFORMER_CONFIG)
    return lay


def resolve_megatron_dir(path: Path) -> tuple[Path, list[str]]:
    """The role folder under what the user gave: the ``actor/`` (or ``critic/``) folder itself, a
    ``global_step_N`` folder (its ``actor/``, else ``critic/``), or a checkpoints root (the step
    named by ``latest_checkpointed_iteration.txt``, else the highest). Returns ``(folder, notes)``;
    the folder is ``path`` unchanged when nothing better is found."""
    path = Path(path)
    notes: list[str] = []
    if not path.is_dir() or find_layout(path) is not None:
        return path, notes
    chosen = choose_step(path)
    if chosen is not None:
        path, note = chosen
        notes.append(note)
        if find_layout(path) is not None:
            return path, notes
    actor, critic = path / "actor", path / "critic"
    if actor.is_dir() and find_layout(actor) is not None:
        if critic.is_dir() and find_layout(critic) is not None:
            notes.append(f"{path.name} also has critic/; reading actor/ (pass the critic/ folder for the critic)")
        return actor, notes
    if critic.is_dir() and find_layout(critic) is not None:
        return critic, notes
    return path, notes


def probe(path: Path) -> bool:
    """True if ``path`` looks like a verl Megatron checkpoint (v1, v2, mbridge, legacy; the role
    folder, its ``global_step_N`` or the checkpoints root) or a Megatron ``torch_dist`` folder.
    Reads only file names and small JSON files."""
    try:
        folder, _ = resolve_megatron_dir(Path(path))
        return find_layout(folder) is not None
    except (CorruptCheckpointError, UnsafeCheckpointError, OSError):
        return True  # it is one, a broken one: let open_megatron say what is wrong


# --------------------------------------------------------------------------------------------
# HF weights as they are (mbridge)
# --------------------------------------------------------------------------------------------


def _hf_weight_files(hf_dir: Path) -> list[Path]:
    if not hf_dir.is_dir():
        return []
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index, "safetensors index")
        files = []
        for rel in dict.fromkeys((data.get("weight_map") or {}).values()):
            files.append(_safe_rel(hf_dir, rel, "safetensors shard"))
        return files
    return sorted(hf_dir.glob("*.safetensors"))


# --------------------------------------------------------------------------------------------
# From Megatron names to HF names: the name table (hf_merge.name_tables.megatron_*), plus what
# only the checkpoint's structure can say (critic or actor, tied output layer, homogeneous layers)
# --------------------------------------------------------------------------------------------


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _load_hf_config(hf_dir: Path | None, config_dir: Path | None, where: Path) -> tuple[Path, dict[str, Any]]:
    cdir = Path(config_dir) if config_dir is not None else hf_dir
    if config_dir is None and hf_dir is not None:
        checkpoint_side_dir(hf_dir, Path(where).parent if Path(hf_dir).parent == Path(where).parent else where)
    if cdir is None or not (cdir / "config.json").is_file():
        looked = f" (looked in {cdir})" if cdir is not None else ""
        raise MissingConfigError(
            f"{where}: no Hugging Face config.json for this Megatron checkpoint{looked}; pass config_dir= "
            "(CLI: --hf_model_config_path) pointing at the base model's folder"
        )
    config = load_config(cdir)  # a JSON object, with architectures / text_config shapes checked
    for key in _INT_FIELDS:  # the sizes the name mapping and the QKV split compute with
        value = config_fields.get(config, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise MissingConfigError(
                f"{cdir / 'config.json'}: {key} is {str(value)[:40]!r}, not a positive integer; fix it or pass config_dir= "
                "(CLI: --hf_model_config_path) with the base model's config"
            )
    return cdir, config


_INT_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "num_hidden_layers",
               "intermediate_size", "vocab_size")


def _check_heads(config: Mapping[str, Any], tconf: Mapping[str, Any] | None, cfg_path: Path) -> None:
    """The head counts the QKV split uses (from config.json) agree with transformer_config.json."""
    nq, nkv, hd = attention_heads(config, str(cfg_path))
    for ours, theirs, val in (
        ("num_attention_heads", "num_attention_heads", nq),
        ("num_key_value_heads", "num_query_groups", nkv),
        ("head_dim", "kv_channels", hd),
    ):
        t = (tconf or {}).get(theirs)
        if isinstance(t, int) and t != val:
            raise MappingError(
                f"config.json {ours}={val} but the Megatron {TRANSFORMER_CONFIG} has {theirs}={t}; "
                "the HF config does not describe this checkpoint (pass the right config_dir)"
            )


_LAYER_RE = re.compile(r"^(\d+)\.(.+)$")


def _name_list(names: Sequence[str]) -> str:
    shown = ", ".join(sorted(names)[:_MAX_NAMED])
    more = len(names) - _MAX_NAMED
    return shown + (f" (and {more} more)" if more > 0 else "")


@dataclass
class _Head:
    """What the output layer says: an actor (lm_head, maybe tied) or a critic (value head)."""

    value_model: bool
    tied: bool
    config_overrides: ConfigOverrides
    notes: list[str]
    warnings: list[str]


def _output_head(
    specs: Mapping[str, TensorSpec], table: NameTable, config: Mapping[str, Any], is_value_model: bool | None, where: str
) -> _Head:
    present = {k: specs[k] for k in (OUTPUT_LAYER, OUTPUT_BIAS) if k in specs}
    head_spec = present.get(OUTPUT_LAYER)
    notes: list[str] = []
    warnings: list[str] = []
    overrides = ConfigOverrides()
    vocab = config.get("vocab_size")
    looks_value = head_spec is not None and len(head_spec.shape) == 2 and head_spec.shape[0] == 1 and vocab != 1
    if is_value_model is None:
        value_model = looks_value
        if value_model:
            notes.append(f"{OUTPUT_LAYER} is {list(head_spec.shape)}: a critic / value head, written as a token classifier")
    else:
        value_model = bool(is_value_model)
        if value_model and head_spec is not None and not looks_value:
            raise MappingError(
                f"{where}: is_value_model was set but {OUTPUT_LAYER} is {list(head_spec.shape)}, a language-model head; "
                "drop --is-value-model"
            )
        if not value_model and looks_value:
            raise MappingError(
                f"{where}: {OUTPUT_LAYER} is {list(head_spec.shape)}, a value head; this is a critic / reward "
                "checkpoint: pass is_value_model=True (--is-value-model)"
            )
    if value_model:
        if head_spec is None:
            raise MappingError(f"{where}: a value model needs its value head {OUTPUT_LAYER}, which is not in the checkpoint")
        arch = table.architectures.get("value")
        if arch is None or not table.value_rules:
            raise MappingError(f"{where}: the {table.name} table has no value-model architecture")
        overrides = ConfigOverrides.value_head(arch, bias=OUTPUT_BIAS in present)
        return _Head(True, False, overrides, notes, warnings)
    if OUTPUT_BIAS in present:
        raise MappingError(f"{where}: {OUTPUT_BIAS} is a value-head tensor but the checkpoint is not a value model")
    tied = OUTPUT_LAYER not in present
    cfg_tied = config_fields.ties_word_embeddings(config)  # an absent key: the config class's default
    if tied and cfg_tied is not True:
        overrides = ConfigOverrides(tie_word_embeddings=True)
        warnings.append(
            f"the checkpoint has no {OUTPUT_LAYER} (Megatron shares the embedding as output layer) "
            f"but config.json has tie_word_embeddings={cfg_tied!r}; the output config ties them"
        )
    elif not tied and cfg_tied is True:
        overrides = ConfigOverrides(tie_word_embeddings=False)
        warnings.append(
            f"config.json ties the embeddings but the checkpoint has a separate {OUTPUT_LAYER}; "
            "it is kept as lm_head.weight and the output config unties them"
        )
    archs = config.get("architectures") or []
    want = table.architectures.get("causal_lm")
    if archs and want and want not in archs:
        notes.append(f"config.json architectures {archs} kept (table default {want})")
    return _Head(False, tied, overrides, notes, warnings)


@dataclass
class _Named:
    view: NameTableView  # the checkpoint under HF names
    head: _Head
    moe: str | None  # "MoE with E experts ...", for inspect; None for a dense model


def hf_names(
    src: LazyCheckpoint, table: NameTable, config: Mapping[str, Any], *, is_value_model: bool | None, where: str
) -> _Named:
    """``src`` (Megatron names) under HF names by ``table``, with the checkpoint's structure checked."""
    try:
        num_layers = int(config_fields.get(config, "num_hidden_layers"))
    except (TypeError, ValueError):
        raise MissingConfigError(f"{where}: config.json lacks num_hidden_layers") from None
    head = _output_head(src.specs(), table, config, is_value_model, where)
    view = NameTableView(src, table.for_value_model() if head.value_model else table, config, where=where)
    if not view.specs():
        raise UnsupportedCheckpointError(f"{where}: no model tensors")
    # Every layer holds what the first layer of its kind (dense / MoE) holds.
    held: dict[int, set[str]] = {i: set() for i in range(num_layers)}
    moe_layers: set[int] = set()
    for r in view.resolved():
        if "layer" in r.values:
            held[r.values["layer"]].add(dict(r.rule.targets)[r.role].removeprefix(HF_LAYER))
            if "expert" in r.values:
                moe_layers.add(r.values["layer"])
    first_of_kind: dict[bool, int] = {}
    for i, names in held.items():
        j = first_of_kind.setdefault(i in moe_layers, i)
        if names != held[j]:
            raise MappingError(
                f"{where}: layer {i} has tensors {sorted(names ^ held[j])} that layer {j} does not (or the "
                "reverse); the checkpoint is incomplete or heterogeneous"
            )
    if view.skipped:
        head.notes.append(f"{len(view.skipped)} optimizer / rng entries in the dist_ckpt ignored")
    moe = None
    if moe_layers:
        topk = config_fields.get(config, "num_experts_per_tok")
        example = sorted({t.removeprefix(HF_LAYER).replace("{expert}", "{e}") for r in table.rules
                          for _, t in r.targets if "{expert}" in t})
        moe = (
            f"MoE with {config_fields.get(config, table.sizes['expert'])} experts" + (f" (top-{topk})" if isinstance(topk, int) else "")
            + f" in {len(moe_layers)} of {num_layers} layers; written one tensor per expert "
            f"({HF_LAYER.format(layer='{i}')} + {', '.join(example)}), as save_pretrained writes"
        )
    return _Named(view, head, moe)


def _table_for(config: Mapping[str, Any], cdir: Path, tconf: Mapping[str, Any] | None) -> NameTable:
    if not isinstance(config.get("model_type"), str):
        raise MissingConfigError(f"{cdir / 'config.json'}: no model_type")
    table = find_table("megatron", config)
    _check_heads(config, tconf, cdir / "config.json")
    return table


def _infer_tp(dcp: DcpCheckpoint, key: str, stacked: bool) -> int | None:
    boxes = dcp.chunk_boxes(key)
    if stacked:
        boxes = [b for b in boxes if b[0][0] == 0]
    return len(boxes) or None


def _parallel_details(lay: Layout, dcp: DcpCheckpoint | None) -> dict[str, Any]:
    tc = lay.transformer_config or {}
    out: dict[str, Any] = {
        "tp": tc.get("tensor_model_parallel_size"),
        "pp": tc.get("pipeline_model_parallel_size"),
    }
    if tc.get("expert_model_parallel_size") is not None:
        out["ep"] = tc.get("expert_model_parallel_size")
    if tc.get("virtual_pipeline_model_parallel_size"):
        out["vpp"] = tc.get("virtual_pipeline_model_parallel_size")
    if out["tp"] is None and dcp is not None:
        for key in dcp.specs():
            if key.endswith("self_attention.linear_qkv.weight") and not key.startswith("optimizer"):
                out["tp"] = _infer_tp(dcp, key, not _LAYER_RE.match(key[len("decoder.layers.") :]))
                out["tp_inferred"] = True
                break
    return {k: v for k, v in out.items() if v is not None}


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def open_megatron(
    path: Path,
    *,
    config_dir: Path | None = None,
    is_value_model: bool | None = None,
) -> LazyCheckpoint:
    """Open a verl Megatron checkpoint as a lazy checkpoint of HF-named tensors.

    Args:
        path: the role folder (``global_step_N/actor`` or ``.../critic``), a ``dist_ckpt`` folder,
            or the folder holding ``model/mp_rank_*`` (legacy).
        config_dir: folder with the HF ``config.json`` (default: the checkpoint's ``huggingface/``).
        is_value_model: force (True) or forbid (False) reading a critic; None: decided by the
            head's shape (``[1, H]`` is a value head).

    Returns:
        A :class:`~hf_merge.checkpoint.LazyCheckpoint` whose ``info`` is
        ``CheckpointInfo(format="megatron", hf_dir=<config folder>, details={layout, tp, pp, [ep],
        num_layers, family, value_model, tied, ...}, config_overrides=...)``.

    Raises:
        SourceNotFoundError, UnsupportedCheckpointError, MissingConfigError, MappingError,
        CorruptCheckpointError, UnsafeCheckpointError.
    """
    path = Path(path)
    if not path.exists():
        raise SourceNotFoundError(f"{path} does not exist")
    path, resolve_notes = resolve_megatron_dir(path)
    lay = find_layout(path)
    if lay is None:
        raise UnsupportedCheckpointError(
            f"{path} is not a verl Megatron checkpoint: expected dist_ckpt/ (v1), ckpt_contents.json or "
            "model/dist_ckpt/ (v2), model/mp_rank_*/model.pt (legacy), or a torch_dist folder"
        )
    if lay.kind == "legacy":
        return _open_legacy(path, lay, config_dir=config_dir, is_value_model=is_value_model, notes=resolve_notes)

    dcp = None
    if lay.dist_dir is not None and lay.dist_dir.is_dir():
        if not is_dcp_dir(lay.dist_dir):
            if any(lay.dist_dir.iterdir()):
                raise CorruptCheckpointError(
                    f"{lay.dist_dir} has no .metadata file: the save did not finish (or files were lost); "
                    "use another step"
                )
        else:
            dcp = DcpCheckpoint(lay.dist_dir)
    details: dict[str, Any] = {"layout": lay.kind, **_parallel_details(lay, dcp)}
    if lay.manifest is not None:
        details["role"] = lay.manifest.get("role")
        details["global_step"] = lay.manifest.get("global_step")
    step = details.get("global_step") if isinstance(details.get("global_step"), int) else _step_from(path)

    model_entry = ((lay.manifest or {}).get("contents") or {}).get("model") or {}
    if model_entry.get("format") == "megatron_dist_checkpoint" and dcp is None:
        raise CorruptCheckpointError(
            f"{lay.root / MANIFEST} lists the model at {model_entry.get('path')!r}, but {lay.dist_dir} holds no "
            "torch_dist checkpoint; the checkpoint is incomplete"
        )
    manifest_says_hf = model_entry.get("format") == "huggingface"

    # Which of the dist_ckpt entries are model tensors?
    model_keys: list[str] = []
    other = 0
    if dcp is not None:
        for k in dcp.specs():
            if _matches(k, NOT_MODEL):
                other += 1
            else:
                model_keys.append(k)
    if manifest_says_hf and model_keys:
        # mbridge + PEFT: model/dist_ckpt holds the adapter shards, the base model is HF.
        details["dist_ckpt_tensors_not_merged"] = len(model_keys)
        adapter = model_entry.get("peft_adapter_path")
        if isinstance(adapter, str):
            details["peft_adapter_dir"] = str(_safe_rel(lay.root, adapter, "peft_adapter_path"))
        model_keys = []
    if not model_keys:
        weights = _hf_weight_files(lay.hf_dir) if lay.hf_dir is not None else []
        where = lay.dist_dir if lay.dist_dir is not None else lay.root
        if weights:
            cdir, config = _load_hf_config(lay.hf_dir, config_dir, lay.root)
            details.update(layout="mbridge", source_layout=lay.kind, num_layers=config.get("num_hidden_layers"), family=config.get("model_type"))
            if details.get("dist_ckpt_tensors_not_merged"):
                what = (
                    f"{MANIFEST} names the HF folder as the model; the {details['dist_ckpt_tensors_not_merged']} "
                    f"tensors in {where} (PEFT adapter shards) are not merged"
                )
            elif dcp is not None:
                what = f"{where} holds no model tensors ({other} optimizer / rng entries)"
            else:
                what = "there is no model dist_ckpt"
            info = CheckpointInfo(
                format="megatron",
                path=path,
                hf_dir=cdir,
                step=step,
                details=details,
                notes=resolve_notes
                + [
                    f"mbridge checkpoint: {what}; the Hugging Face weights in {lay.hf_dir} are the model "
                    "and are copied as they are (nothing to merge)"
                ],
            )
            from .hf_dir import HfDirCheckpoint  # noqa: PLC0415

            hf = HfDirCheckpoint(lay.hf_dir, config_dir=cdir)
            hf.info = info
            names = hf.specs()
            details.update(
                value_model="score.weight" in names,
                tied="lm_head.weight" not in names and "score.weight" not in names,
            )
            return hf
        if dcp is None:
            raise UnsupportedCheckpointError(
                f"{path}: no model dist_ckpt and no Hugging Face weights in {lay.hf_dir}; nothing to merge"
            )
        raise UnsupportedCheckpointError(
            f"{where} holds no model tensors (only {other} optimizer / rng entries) and {lay.hf_dir} has no "
            "*.safetensors weights: this checkpoint was saved without its model "
            "(verl save_contents without 'model' / 'hf_model'); nothing to merge"
        )

    cdir, config = _load_hf_config(lay.hf_dir, config_dir, lay.root)

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise MissingConfigError(f"{cdir / 'config.json'}: no model_type")
    table = _table_for(config, cdir, lay.transformer_config)
    assert dcp is not None
    named = hf_names(dcp, table, config, is_value_model=is_value_model, where=str(lay.dist_dir))
    if lay.hf_dir is not None and _hf_weight_files(lay.hf_dir):
        named.head.notes.append(f"{lay.hf_dir} also holds HF weights; the dist_ckpt model tensors are used")
    details.update(
        num_layers=int(config_fields.get(config, "num_hidden_layers")),
        family=table.name.split(".", 1)[-1],
        moe=named.moe,
        model_type=model_type,
        value_model=named.head.value_model,
        tied=named.head.tied,
        dist_ckpt=str(lay.dist_dir),
    )
    info = CheckpointInfo(
        format="megatron",
        path=path,
        hf_dir=cdir,
        world_size=dcp.info.world_size,
        step=step,
        details=details,
        notes=resolve_notes + named.head.notes,
        warnings=named.head.warnings,
        config_overrides=named.head.config_overrides,
    )
    named.view.info = info
    return named.view


def _step_from(path: Path) -> int | None:
    for part in reversed(Path(path).absolute().parts):
        m = re.fullmatch(r"global_step_(\d+)", part)
        if m:
            return int(m.group(1))
    return None


# --------------------------------------------------------------------------------------------
# Legacy per-rank files: model/mp_rank_XX[_PPP]/model.pt
# --------------------------------------------------------------------------------------------


#: Legacy ``model.pt``: tensors plus ``_extra_state`` entries that are ``io.BytesIO`` values.
LEGACY_RANK_FILE = TENSOR_FILE | Allowlist.of(calls=[("_io", "BytesIO")], classes=[("_io", "BytesIO")])


def _load_rank_file(path: Path) -> list[dict[str, Any]]:
    """``torch.load`` one legacy rank file under :data:`LEGACY_RANK_FILE` (records checked,
    memory-mapped, weights only) -> list of state dicts (one per virtual pipeline stage)."""
    obj = torch_load(contained.check(path), LEGACY_RANK_FILE, str(path))
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        sds = [obj["model"]]
    elif isinstance(obj, dict) and any(re.fullmatch(r"model\d+", k) for k in obj):
        sds = [obj[k] for k in sorted((k for k in obj if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))]
    elif isinstance(obj, (list, tuple)):
        sds = list(obj)
    elif isinstance(obj, dict):
        sds = [obj]
    else:
        raise UnsupportedCheckpointError(f"{path}: holds a {type(obj).__name__}, not a model state dict")
    out = []
    for sd in sds:
        if not isinstance(sd, dict):
            raise UnsupportedCheckpointError(f"{path}: holds a {type(sd).__name__}, not a model state dict")
        tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
        if tensors and all(k.startswith("module.") for k in tensors):
            tensors = {k[len("module.") :]: v for k, v in tensors.items()}
        out.append(tensors)
    return out


class _AssembledTensors(LazyCheckpoint):
    """Global tensors put together from local pieces (memory-mapped tensors) at known offsets."""

    def __init__(self, info: CheckpointInfo):
        self.info = info
        self._specs: dict[str, TensorSpec] = {}
        self._pieces: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        self._mapped: list[MappedFile] = []  # the files, open until close()

    def track(self, path: Path, tensors: list[torch.Tensor]) -> None:
        """Make the records of ``path`` (whose mapped ``tensors`` this object keeps) CRC-checkable."""
        source = record_crc.mapped_file(path, tensors)
        if source is not None:
            self._mapped.append(source)

    def close(self) -> None:
        for source in self._mapped:
            source.close()
        self._mapped.clear()

    def add(self, name: str, shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        dtypes = {t.dtype for _, t in pieces}
        if len(dtypes) != 1:
            raise CorruptCheckpointError(f"{self.info.path}: the pieces of {name} have different dtypes {sorted(map(str, dtypes))}")
        covered = sum(t.numel() for _, t in pieces)
        numel = 1
        for d in shape:
            numel *= d
        if covered != numel:
            raise CorruptCheckpointError(f"{self.info.path}: the pieces of {name} cover {covered} of {numel} elements")
        self._specs[name] = TensorSpec(name, shape, dtypes.pop())
        self._pieces[name] = pieces

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read_into(self, name: str, out: torch.Tensor) -> None:
        spec = self._specs[name]
        check_out(spec, out)
        self.read_region_into(name, (0,) * len(spec.shape), out)

    def read_region_into(self, name: str, start: Sequence[int], out: torch.Tensor) -> None:
        size = tuple(out.shape)
        for offsets, t in self._pieces[name]:
            lo = [max(s, o) for s, o in zip(start, offsets)]
            hi = [min(s + n, o + z) for s, n, o, z in zip(start, size, offsets, t.shape)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            record_crc.check_tensor(t, source_of(t, self._mapped))
            src = t[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
            out[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))].copy_(src)


def _tp_pieces(
    name: str, rule: Any, local: list[torch.Tensor], where: str
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]:
    """Global shape and pieces of one tensor from its TP-rank-ordered local shards."""
    shapes = {tuple(t.shape) for t in local}
    if len(shapes) != 1:
        raise CorruptCheckpointError(f"{where}: {name} has different shapes on the TP ranks: {sorted(shapes)}")
    shape = shapes.pop()
    tp = len(local)
    zero = (0,) * len(shape)
    if rule is None or tp == 1:
        return shape, [(zero, local[0])]
    if rule in (0, 1):
        if rule >= len(shape):
            raise MappingError(f"{where}: {name} has no dim {rule} to join the TP shards along")
        g = list(shape)
        g[rule] *= tp
        pieces = []
        for r, t in enumerate(local):
            off = [0] * len(shape)
            off[rule] = r * shape[rule]
            pieces.append((tuple(off), t))
        return tuple(g), pieces
    if rule == "gate_up":
        if shape[0] % 2:
            raise MappingError(f"{where}: {name} has an odd number of rows; cannot be a [gate; up] shard")
        f = shape[0] // 2
        total = f * tp
        pieces = []
        for r, t in enumerate(local):
            pieces.append(((r * f,) + zero[1:], t[:f]))
            pieces.append(((total + r * f,) + zero[1:], t[f:]))
        return (2 * total,) + shape[1:], pieces
    raise MappingError(f"{where}: unknown tensor_parallel rule {rule!r} for {name}")


def _open_legacy(
    path: Path, lay: Layout, *, config_dir: Path | None, is_value_model: bool | None, notes: list[str]
) -> LazyCheckpoint:

    assert lay.legacy_dir is not None
    grid: dict[tuple[int, int], Path] = {}
    for d in sorted(lay.legacy_dir.iterdir()):
        m = _MP_RANK.match(d.name)
        if not m or not (d / "model.pt").is_file():
            continue
        tp_rank, pp_rank = int(m.group(1)), int(m.group(2) or 0)
        if m.group(3) is not None:
            raise UnsupportedCheckpointError(
                f"{d}: expert-parallel legacy files (mp_rank_XX_PPP_EEE) are not supported; re-save with "
                "dist checkpointing (torch_dist)"
            )
        grid[(tp_rank, pp_rank)] = d / "model.pt"
    tp = max(t for t, _ in grid) + 1
    pp = max(p for _, p in grid) + 1
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp) if (t, p) not in grid]
    if missing:
        raise CorruptCheckpointError(f"{lay.legacy_dir}: rank files missing for {', '.join(missing)} (TP={tp}, PP={pp})")

    cdir, config = _load_hf_config(lay.hf_dir, config_dir, lay.root)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise MissingConfigError(f"{cdir / 'config.json'}: no model_type")
    table = _table_for(config, cdir, lay.transformer_config)
    lp = LAYER
    rules = _TENSOR_PARALLEL
    if tp > 1 and "expert" in table.sizes:
        raise UnsupportedCheckpointError(
            f"{lay.legacy_dir}: legacy per-rank files of an MoE model ({table.name}) saved at TP={tp} are not "
            "supported (expert tensor-parallel layouts vary); re-save with dist checkpointing (torch_dist)"
        )

    # files[p][t] = list over virtual stages of state dicts
    files = [[_load_rank_file(grid[(t, p)]) for t in range(tp)] for p in range(pp)]
    vpp = {len(files[p][t]) for p in range(pp) for t in range(tp)}
    if len(vpp) != 1:
        raise CorruptCheckpointError(f"{lay.legacy_dir}: rank files hold different numbers of virtual pipeline stages {sorted(vpp)}")
    vpp_n = vpp.pop()

    def local_layers(sd: dict[str, Any]) -> list[int]:
        idx = set()
        for k in sd:
            if k.startswith(lp):
                m = _LAYER_RE.match(k[len(lp) :])
                if m:
                    idx.add(int(m.group(1)))
        return sorted(idx)

    info = CheckpointInfo(format="megatron", path=path, hf_dir=cdir, world_size=tp * pp, step=_step_from(path))
    src = _AssembledTensors(info)
    src.zip_archives = lambda: [(grid[k], 0, None) for k in sorted(grid)]  # for CRC checks
    for (t, p), rank_file in grid.items():  # each tensor's record is found through its file offset
        src.track(rank_file, [x for sd in files[p][t] for x in sd.values()])
    notes = list(notes)
    offset = 0
    where = str(lay.legacy_dir)
    seen_globals: dict[str, tuple[int, int]] = {}
    drop_tied_copy = config_fields.ties_word_embeddings(config) and pp * vpp_n > 1
    for v in range(vpp_n):
        for p in range(pp):
            sds = [files[p][t][v] for t in range(tp)]
            keys = list(sds[0])
            for t in range(1, tp):
                if set(sds[t]) != set(keys):
                    raise CorruptCheckpointError(
                        f"{where}: TP ranks 0 and {t} of pipeline stage {p} hold different tensors: "
                        f"{_name_list(sorted(set(sds[t]) ^ set(keys)))}"
                    )
            layers = local_layers(sds[0])
            if layers and layers != list(range(len(layers))):
                raise CorruptCheckpointError(f"{where}: pipeline stage {p} has non-contiguous local layers {layers}")
            for k in keys:
                if table.ignored(k):
                    continue
                m = _LAYER_RE.match(k[len(lp) :]) if k.startswith(lp) else None
                if m:
                    suffix = m.group(2)
                    name = f"{lp}{offset + int(m.group(1))}.{suffix}"
                    rule = rules.get(suffix)
                else:
                    name = k
                    rule = rules.get(k)
                    if k in seen_globals:
                        if k == OUTPUT_LAYER and drop_tied_copy:
                            continue
                        raise CorruptCheckpointError(
                            f"{where}: {k} is on pipeline stages {seen_globals[k][1]} and {p}; only a tied "
                            "output layer may repeat"
                        )
                    seen_globals[k] = (v, p)
                    if k == OUTPUT_LAYER and drop_tied_copy and EMBEDDING in seen_globals:
                        notes.append(f"{k} on the last pipeline stage is Megatron's copy of the tied embedding; not written")
                        del seen_globals[k]
                        continue
                local = [sd[k] for sd in sds]
                if k in (OUTPUT_LAYER, OUTPUT_BIAS) and local[0].ndim >= 1 and local[0].shape[0] == 1:
                    rule = None  # a [1, H] value head is replicated, not vocab-parallel
                shape, pieces = _tp_pieces(name, rule, local, where)
                src.add(name, shape, pieces)
            offset += len(layers)
    if offset != config_fields.get(config, "num_hidden_layers"):  # an int or absent (checked by _load_hf_config)
        raise MappingError(
            f"{where}: the rank files hold {offset} layers but config.json has num_hidden_layers="
            f"{config_fields.get(config, 'num_hidden_layers')}; is config.json the right one?"
        )
    if drop_tied_copy and OUTPUT_LAYER in src.specs():
        # The copy was seen before the embedding (cannot happen in stage order); keep it honest.
        raise CorruptCheckpointError(f"{where}: tied output layer found before the embedding")

    named = hf_names(src, table, config, is_value_model=is_value_model, where=where)
    details = {
        "layout": "legacy",
        "tp": tp,
        "pp": pp,
        "vpp": vpp_n if vpp_n > 1 else None,
        "num_layers": offset,
        "family": table.name.split(".", 1)[-1],
        "moe": named.moe,
        "model_type": model_type,
        "value_model": named.head.value_model,
        "tied": named.head.tied,
    }
    info.details = {k: v for k, v in details.items() if v is not None}
    info.notes = notes + named.head.notes
    info.warnings = named.head.warnings
    info.config_overrides = named.head.config_overrides
    named.view.info = info
    return named.view


FORMAT = SourceFormat(
    name="megatron",
    description="verl Megatron-LM / Megatron-Core checkpoints (torch_dist v1/v2, mbridge, legacy mp_rank_XX)",
    probe=probe,
    open=open_megatron,
    options=frozenset({"is_value_model"}),
    priority=20,
    framework="verl",
)
