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
  the dims Megatron splits them on, PP stages by their layer offsets (:mod:`.megatron_legacy`).
- ``"dist_ckpt"``: a bare ``torch_dist`` folder outside a verl layout (``config_dir`` required).

Names (the contract): the reader yields Megatron-Core's own names and layouts, read with no
renaming: the ``torch_dist`` entries as the folder's ``.metadata`` lists them, through
:class:`~hf_merge.readers.dcp.DcpCheckpoint` (per-layer tensors with a leading layer axis,
``decoder.layers.self_attention.linear_qkv.weight`` ``[L, (nq+2nkv)*hd, H]``, or one key per layer,
``decoder.layers.<i>.…``, when saved with ``singleton_local_shards``), and the legacy rank files as
the model's ``state_dict()`` (``decoder.layers.<i>.…`` with global layer numbers: the only layout
work the reader does is joining TP shards and placing PP / virtual stages). Everything else is the
family's name table (:mod:`hf_merge.transforms.name_tables.megatron_gpt`, :mod:`hf_merge.transforms.name_tables.megatron_moe`)
applied by the one interpreter, :class:`~hf_merge.transforms.name_table_view.NameTableView`: stacked layer
and expert axes unstacked, fused QKV and gate/up tensors split by role (lazily, as row regions),
1:1 renames, and a tensor the table does not know is a :class:`~hf_merge.errors.MappingError`
naming it. The reader adds what only the checkpoint's structure says: critic or actor, a tied
output layer, layers that all hold the same tensors. ``open_megatron(...).base`` is the checkpoint
under its Megatron names; ``hf-merge inspect --tensors`` shows the source of every HF tensor.

Critic / value model: a ``[1, H]`` output layer (or ``is_value_model=True``) is written as
``score.weight`` of ``<Family>ForTokenClassification`` with ``num_labels=1``; the config changes
the writer must apply are in ``info.config_overrides`` (a :class:`~hf_merge.readers.config_overrides.ConfigOverrides`),
which also carries
``tie_word_embeddings`` when the checkpoint's structure disagrees with config.json.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from . import contained, megatron_legacy
from ..checkpoint import CheckpointInfo, LazyCheckpoint
from .. import config_fields
from .config_overrides import ConfigOverrides
from ..errors import (
    CorruptCheckpointError,
    MappingError,
    MissingConfigError,
    SourceNotFoundError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from .formats import SourceFormat
from ..spec import TensorSpec
from ..transforms.name_tables.megatron_gpt import HF_LAYER, LAYER_INDEX, NOT_MODEL, OUTPUT_BIAS, OUTPUT_LAYER
from ..transforms.name_table import NameTable, find_table
from ..transforms.name_table_view import NameTableView, attention_heads
from .dcp_index import is_dcp_dir
from .fsdp_files import choose_step
from ..hf_files import checkpoint_side_dir, load_config

if TYPE_CHECKING:  # probing (and the head start's index) imports this module without torch
    from .dcp import DcpCheckpoint

__all__ = ["probe", "open_megatron", "open_index", "find_layout", "resolve_megatron_dir"]

MANIFEST = "ckpt_contents.json"
TRANSFORMER_CONFIG = "transformer_config.json"


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
    elif (legacy := megatron_legacy.legacy_dir(path)) is not None:
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
    chosen = choose_step(path, lambda step: any(find_layout(p) is not None for p in (step, step / "actor", step / "critic")))
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
# From Megatron names to HF names: the name table (hf_merge.transforms.name_tables.megatron_*), plus what
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
            f"{where}: no Hugging Face config.json for this Megatron checkpoint{looked}; pass --config DIR "
            "(alias --hf_model_path) with the base model's config.json"
        )
    config = load_config(cdir)  # a JSON object, with architectures / text_config shapes checked
    for key in _INT_FIELDS:  # the sizes the name mapping and the QKV split compute with
        value = config_fields.get(config, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise MissingConfigError(
                f"{cdir / 'config.json'}: {key} is {str(value)[:40]!r}, not a positive integer; fix it or pass --config DIR "
                "with the base model's config"
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
                "the HF config does not describe this checkpoint (pass --config DIR with the right one)"
            )


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
                out["tp"] = _infer_tp(dcp, key, not LAYER_INDEX.match(key[len("decoder.layers.") :]))
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
            from .dcp import DcpCheckpoint

            dcp = DcpCheckpoint(lay.dist_dir)
    details: dict[str, Any] = {"layout": lay.kind, **_parallel_details(lay, dcp)}
    if lay.manifest is not None:
        details["role"] = lay.manifest.get("role")
        details["global_step"] = lay.manifest.get("global_step")
    step = details.get("global_step") if isinstance(details.get("global_step"), int) else _step_from(path)

    model_entry = _manifest_model(lay)
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


def _manifest_model(lay: Layout) -> dict[str, Any]:
    """The manifest's entry for the model (``contents.model`` of ckpt_contents.json), or {}."""
    return ((lay.manifest or {}).get("contents") or {}).get("model") or {}


def open_index(path: Path, config: Path | None):
    """The model's tensors under Hugging Face names, read without torch, for the CLI's head start:
    the name table :func:`open_megatron` applies, over a :class:`~hf_merge.readers.dcp_index.DcpIndex`
    of the ``torch_dist`` folder's model entries (a TP>1 row-parallel weight's rows as
    ``ColumnGather`` s), and the folder of config.json. None (no head start) for the legacy and
    mbridge layouts, a critic, and a folder the reader parses with a process per CPU."""
    from .dcp_index import PARALLEL_CHUNKS, DcpIndex

    folder, _ = resolve_megatron_dir(Path(path))
    lay = find_layout(folder)
    if lay is None or lay.kind == "legacy" or lay.dist_dir is None or not is_dcp_dir(lay.dist_dir):
        return None
    if _manifest_model(lay).get("format") == "huggingface":  # mbridge: the HF folder is the model
        return None
    index = DcpIndex(lay.dist_dir)
    try:
        keys = [k for k in index.tensors if not _matches(k, NOT_MODEL)]
        if not keys or sum(map(len, index.chunks.values())) >= PARALLEL_CHUNKS:
            index.close()
            return None
        index.select({k: k for k in keys})
        cdir, hf_config = _load_hf_config(lay.hf_dir, config, lay.root)
        named = hf_names(index, _table_for(hf_config, cdir, lay.transformer_config), hf_config, is_value_model=None,
                         where=str(lay.dist_dir))
        if named.head.value_model or named.head.tied:
            index.close()
            return None
        return named.view, cdir
    except BaseException:
        index.close()
        raise


def _step_from(path: Path) -> int | None:
    for part in reversed(Path(path).absolute().parts):
        m = re.fullmatch(r"global_step_(\d+)", part)
        if m:
            return int(m.group(1))
    return None


def _open_legacy(
    path: Path, lay: Layout, *, config_dir: Path | None, is_value_model: bool | None, notes: list[str]
) -> LazyCheckpoint:
    assert lay.legacy_dir is not None
    grid = megatron_legacy.rank_grid(lay.legacy_dir)
    cdir, config = _load_hf_config(lay.hf_dir, config_dir, lay.root)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise MissingConfigError(f"{cdir / 'config.json'}: no model_type")
    table = _table_for(config, cdir, lay.transformer_config)
    info = CheckpointInfo(format="megatron", path=path, hf_dir=cdir, world_size=grid.tp * grid.pp, step=_step_from(path))
    try:
        ranks = megatron_legacy.assemble(grid, table, config, info)
        named = hf_names(ranks.tensors, table, config, is_value_model=is_value_model, where=str(lay.legacy_dir))
    except MappingError as e:  # shapes or layers short of the config: the last TP ranks or PP stages may be gone
        found = ", ".join(sorted(p.parent.name for p in grid.files.values()))
        raise MappingError(f"{e} (or rank folders are missing: {lay.legacy_dir} holds {found} only, "
                           f"TP={grid.tp} x PP={grid.pp})") from None
    details = {
        "layout": "legacy",
        "tp": grid.tp,
        "pp": grid.pp,
        "vpp": ranks.vpp if ranks.vpp > 1 else None,
        "num_layers": ranks.num_layers,
        "family": table.name.split(".", 1)[-1],
        "moe": named.moe,
        "model_type": model_type,
        "value_model": named.head.value_model,
        "tied": named.head.tied,
    }
    info.details = {k: v for k, v in details.items() if v is not None}
    info.notes = list(notes) + ranks.notes + named.head.notes
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
    # the role folder, its global_step_N or the checkpoints root (the path, */ or */*/), with a
    # manifest, model/ (dist_ckpt, huggingface, legacy mp_rank_*), dist_ckpt/, mp_rank_* or a torch_dist metadata.json
    marks=(
        "ckpt_contents.json", "model", "dist_ckpt", "mp_rank_*", "metadata.json",
        "*/ckpt_contents.json", "*/model", "*/dist_ckpt", "*/mp_rank_*", "*/metadata.json",
        "*/*/ckpt_contents.json", "*/*/model", "*/*/dist_ckpt", "*/*/mp_rank_*", "*/*/metadata.json",
    ),
)
