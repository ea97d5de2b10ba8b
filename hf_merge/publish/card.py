"""Model cards (``README.md``) for merged models and PEFT adapters, from the provenance record.

Every merge writes its provenance to ``TARGET/hf_merge.json``; :func:`render_model_card` and
:func:`render_adapter_card` turn that record into a Hub model card, built with huggingface_hub's
``ModelCard`` / ``ModelCardData`` (YAML front matter validated the same way the Hub does).

Provenance record (``hf_merge.json``, written by :func:`hf_merge.merge`). Keys marked
*optional* may be absent; the others are always written, ``null`` where the fact is unknown::

    {
      "hf_merge_version": "0.1.0",                 # hf_merge.__version__ that wrote the folder
      "created": "2026-01-01T00:00:00+00:00",      # optional: UTC time of the merge
      "source": {
        "format": "fsdp",                          # the format's name (docs/formats.md): "fsdp",
                                                   #   "megatron", "deepspeed", "dcp", "hf", ...
                                                   #   (open set; older names such as "verl-fsdp"
                                                   #   are read as their format's name)
        "framework": "verl",                       # training framework, or null
        "path": "/ckpt/global_step_100/actor",     # as given on the command line
        "world_size": 8,                           # ranks that wrote it, or null
        "step": 100,                               # training step, or null
        "mesh": [2, 4],                            # optional: device mesh shape from the DTensors
        "mesh_dim_names": ["ddp", "fsdp"],         # optional: its dimension names
        "fsdp_version": 2,                         # optional; other format details may follow
        "options": {"source_weights": "module"},   # optional: reader options given (DeepSpeed tag,
                                                   #   source_weights); verify --against reads with them
        "role": "actor"                            # optional: "actor" | "critic" | ...
      },
      "dtype": "bfloat16",                         # dtype of the written floating weights (config.json's)
      "dtype_option": "config",                    # optional: what --dtype asked for (config/auto/a dtype)
      "base_model": "Qwen/Qwen2.5-0.5B",           # model trained from (Hub id or a local path), or null
      "architecture": "Qwen2ForCausalLM",          # config.json "architectures"[0], or null
      "lora": null | {
        "mode": "fuse" | "adapter" | "both",       # fused into W / PEFT folder / both
        "r": 8, "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "use_rslora": false,
        "adapter_dtype": "float32",                # optional: dtype of the adapter's tensors
        "adapter_subfolder": "lora_adapter"        # optional, mode "both": where the adapter is
      },                                           #   (more keys allowed, e.g. "alpha_source")
      "quantization": null | {"method": "bitsandbytes", "mode": "nf4" | "fp4" | "int8"},
      "verification": null | {"passed": true, "summary": "..."},
      "missing_files": ["tokenizer", "generation_config.json"],   # optional: side files not found
      "files": {"model.safetensors": "crc32:<hex>" or "<sha256 hex>", ...}   # optional: every file written
                                                   #   but README.md and this record (docs/integrity.md)
    }

Rendering is lenient: a missing key is shown as unknown (or left out), never an error.

What the card says, from that record:

- YAML: ``library_name`` (``transformers``; ``peft`` for an adapter), ``base_model`` (only when it
  is a valid Hub repo id: a local path would be published and would not resolve), with
  ``base_model_relation``: ``adapter`` for an adapter card, ``quantized`` when the weights are the
  base model's own weights quantized (source format ``hf``), else ``finetune`` (weights from a
  training checkpoint, quantized or not: calling a quantized fine-tune "quantized" would list it
  among the base model's quantizations on the Hub). ``tags``: ``hf-merge``, the framework
  (``verl``), the backend (``fsdp``, ``megatron``, ...), ``lora``, ``bitsandbytes`` + the mode +
  ``4-bit``/``8-bit``. ``pipeline_tag`` from the architecture's suffix (``text-generation`` for
  ``*ForCausalLM``).
- Body: an ``hf-merge provenance`` section between HTML comment markers, holding the provenance
  table, the file checksums and a loading snippet. Only the last two components of
  ``source.path`` are shown, so a card does not publish the local directory layout.

An existing card (for example the source's ``huggingface/README.md``) is never overwritten: its
text and YAML are kept, missing fields are added, tags are merged, and the provenance section is
appended, or replaced when a previous run already appended one (so re-running is idempotent).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ..errors import HubError, folded
from ..progress import count
from ..write.atomic import PROVENANCE_FILE

__all__ = ["render_model_card", "render_adapter_card", "write_card", "card_text", "SECTION_BEGIN", "SECTION_END"]

logger = logging.getLogger(__name__)

#: the card's temporary file while it is written (``hf_merge.publish.hub.push`` never uploads these)
TMP_PREFIX = ".hf_merge-"

SECTION_BEGIN = "<!-- hf-merge provenance: begin -->"
SECTION_END = "<!-- hf-merge provenance: end -->"

# Architecture class-name suffix -> (transformers Auto class, Hub pipeline tag). Longest suffix wins.
_ARCH_TASKS: dict[str, tuple[str, str | None]] = {
    "ForCausalLM": ("AutoModelForCausalLM", "text-generation"),
    "LMHeadModel": ("AutoModelForCausalLM", "text-generation"),
    "ForSequenceClassification": ("AutoModelForSequenceClassification", "text-classification"),
    "ForTokenClassification": ("AutoModelForTokenClassification", "token-classification"),
    "ForQuestionAnswering": ("AutoModelForQuestionAnswering", "question-answering"),
    "ForMaskedLM": ("AutoModelForMaskedLM", "fill-mask"),
    "ForConditionalGeneration": ("AutoModelForImageTextToText", "image-text-to-text"),
}
# Tags per quantization mode, besides the method name.
_QUANT_TAGS = {"nf4": ["nf4", "4-bit"], "fp4": ["fp4", "4-bit"], "int8": ["8-bit"]}
_LORA_MODES = {
    "fuse": "fused into the weights",
    "adapter": "kept as a PEFT adapter",
    "both": "fused into the weights, and kept as a PEFT adapter",
}
_ADAPTER_SUBFOLDER = "lora_adapter"  # where hf_merge.merge puts the adapter in LoRA mode "both"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

_SECTION_TEMPLATE = """\
{{ begin }}
## hf-merge provenance

{{ summary }}

| | |
|---|---|
{% for key, value in rows %}
| {{ key }} | {{ value }} |
{% endfor %}

{% if files %}
<details>
<summary>Files written by the merge (checksums)</summary>

| file | checksum |
|---|---|
{% for name, digest in files %}
| `{{ name }}` | `{{ digest }}` |
{% endfor %}

</details>

{% endif %}
### Loading

```python
{{ snippet }}
```
{{ end }}
"""

_CARD_TEMPLATE = """\
---
{{ card_data }}
---

# {{ title }}

{{ section }}"""


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def render_model_card(
    info: dict[str, Any],
    *,
    repo_id: str | None = None,
    existing_card_text: str | None = None,
    folder_files: Iterable[str] | None = None,
) -> str:
    """Render the ``README.md`` of a merged model folder.

    Args:
        info: the provenance record (the content of ``hf_merge.json``, schema in the module doc).
        repo_id: the Hub repo the folder goes to; used in the title and the loading snippet
            (a placeholder is shown when None).
        existing_card_text: a card to extend instead of starting afresh; its text and YAML are
            kept, never overwritten.
        folder_files: names of the files in the folder (default: ``info["files"]``); the loading
            snippet loads a tokenizer only when tokenizer files are among them.

    Returns:
        The card's full text: YAML front matter, then Markdown.
    """
    return _render(info, repo_id, existing_card_text, folder_files, adapter=False)


def render_adapter_card(
    info: dict[str, Any],
    *,
    repo_id: str | None = None,
    existing_card_text: str | None = None,
    folder_files: Iterable[str] | None = None,
) -> str:
    """Render the ``README.md`` of a PEFT adapter folder (``library_name: peft``).

    Args, returns: as :func:`render_model_card`. ``info["base_model"]`` should name the model the
    adapter applies to; without it the card cannot link the base model (the snippet shows a
    placeholder).
    """
    return _render(info, repo_id, existing_card_text, folder_files, adapter=True)


def write_card(folder: Path, info: dict[str, Any], *, kind: str, repo_id: str | None = None) -> bool:
    """Write ``folder/README.md`` from the provenance record; return True when the file changed.

    A missing README is rendered afresh; an existing one is extended (its text and YAML kept, the
    hf-merge provenance section appended, or refreshed when an earlier run added it).

    Raises:
        HubError: the existing README's YAML header cannot be parsed, or the file cannot be written.
    """
    readme = folder / "README.md"
    text, existing = card_text(folder, info, kind=kind, repo_id=repo_id)
    if text == existing:
        return False
    try:
        _write_atomic(readme, text)
    except OSError as e:
        raise HubError(f"cannot write {readme} ({folded(e)}): make the folder writable, or add a README.md") from e
    logger.debug("%s %s from %s", "extended" if existing else "wrote", readme, PROVENANCE_FILE)
    return True


def card_text(folder: Path, info: dict[str, Any], *, kind: str, repo_id: str | None) -> tuple[str, str | None]:
    """The README.md :func:`write_card` would write, and the current one (None when absent)."""
    import yaml

    readme = folder / "README.md"
    existing = readme.read_text(encoding="utf-8") if readme.is_file() else None
    if kind == "adapter" and not info.get("base_model"):
        info = {**info, "base_model": _adapter_base_model(folder)}
    render = render_adapter_card if kind == "adapter" else render_model_card
    try:
        names = [p.relative_to(folder).as_posix() for p in folder.iterdir() if p.is_file()]
        return render(info, repo_id=repo_id, existing_card_text=existing, folder_files=names), existing
    except (ValueError, yaml.YAMLError) as e:  # from the existing card's header
        if existing is None:
            raise
        raise HubError(f"{readme} has a YAML header that cannot be read ({folded(e)}): fix or remove it") from e


def _adapter_base_model(folder: Path) -> str | None:
    try:
        value = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; a card is as readable as the rest
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------------------------
# facts derived from the record
# ---------------------------------------------------------------------------------------------
def _hub_model_id(name: Any) -> str | None:
    """``name`` when it is a valid Hub repo id, else None (local paths, empty, non-strings)."""
    if not isinstance(name, str) or not name or name.startswith((".", "/", "~")) or "\\" in name:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def _arch_task(architecture: str | None) -> tuple[str, str | None]:
    if architecture:
        for suffix in sorted(_ARCH_TASKS, key=len, reverse=True):
            if architecture.endswith(suffix):
                return _ARCH_TASKS[suffix]
    return "AutoModel", None


def _format(source: dict[str, Any]) -> str | None:
    """The source's format name; an older spelling (``verl-fsdp``) read as the format's name."""
    from ..readers.formats import find_declared

    fmt = source.get("format")
    if not isinstance(fmt, str) or not fmt:
        return None
    found = find_declared(fmt)
    return found.name if found is not None else fmt


def _from_hf_folder(source: dict[str, Any]) -> bool:
    from ..readers.formats import is_hf_folder

    return is_hf_folder(_format(source))


def _backend_tag(source: dict[str, Any]) -> str | None:
    """``fsdp`` -> ``fsdp``; ``megatron`` -> ``megatron``; ``hf`` -> None; an unknown
    ``<framework>-<name>`` -> ``<name>``."""
    fmt = _format(source)
    if fmt is None or _from_hf_folder(source):
        return None
    framework = source.get("framework")
    if isinstance(framework, str) and fmt.startswith(framework + "-"):
        fmt = fmt[len(framework) + 1 :]
    return _slug(fmt)


def _slug(value: str) -> str:
    return re.sub(r"[^a-z0-9.+-]+", "-", value.lower()).strip("-")


def _relation(info: dict[str, Any], adapter: bool) -> str:
    if adapter or _gguf_adapter(info):
        return "adapter"
    if info.get("quantization") and _from_hf_folder(info.get("source") or {}):
        return "quantized"
    return "finetune"


def _tags(info: dict[str, Any], adapter: bool) -> list[str]:
    source = info.get("source") or {}
    tags = ["hf-merge"]
    if isinstance(source.get("framework"), str) and source["framework"]:
        tags.append(_slug(source["framework"]))
    if backend := _backend_tag(source):
        tags.append(backend)
    if info.get("lora") or adapter:
        tags.append("lora")
    quant = info.get("quantization")
    if quant:
        tags.append(_slug(str(quant.get("method") or "quantized")))
        mode = quant.get("mode")
        tags.extend(_QUANT_TAGS.get(str(mode), [_slug(str(mode))] if mode else []))
    return _unique(tags)


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _card_fields(info: dict[str, Any], adapter: bool) -> dict[str, Any]:
    """The YAML fields hf_merge owns, in the order they are written."""
    base = _hub_model_id(info.get("base_model"))
    _, pipeline_tag = _arch_task(info.get("architecture"))
    fields: dict[str, Any] = {"library_name": "peft" if adapter else "gguf" if _gguf(info) else "transformers"}
    if base:
        fields["base_model"] = base
        fields["base_model_relation"] = _relation(info, adapter)
    fields["tags"] = _tags(info, adapter)
    if pipeline_tag:
        fields["pipeline_tag"] = pipeline_tag
    return fields


def _cell(value: Any) -> str:
    """A Markdown table cell: one line, pipes escaped."""
    return re.sub(r"\s+", " ", str(value)).replace("|", "\\|").strip()


def _short_path(path: Any) -> str | None:
    if not isinstance(path, str) or not path:
        return None
    pure = PureWindowsPath(path) if "\\" in path else PurePosixPath(path)
    parts = [p for p in pure.parts if p not in ("/", "\\") and not p.endswith(":\\")]
    return "/".join(parts[-2:]) or None


def _mesh_text(mesh: Any, names: Any = None) -> str | None:
    if not mesh:
        return None
    if isinstance(mesh, (list, tuple)):
        names = list(names or []) + [f"dim{i}" for i in range(len(names or []), len(mesh))]
        return " × ".join(f"{n}={s}" for n, s in zip(names, mesh, strict=False))
    if isinstance(mesh, dict) and "shape" in mesh:  # tolerated: {"dim_names": [...], "shape": [...]}
        names = mesh.get("dim_names") or [f"dim{i}" for i in range(len(mesh["shape"]))]
        return " × ".join(f"{n}={s}" for n, s in zip(names, mesh["shape"], strict=False))
    if isinstance(mesh, dict):  # tolerated: {"fsdp": 8}
        return " × ".join(f"{n}={s}" for n, s in mesh.items())
    return str(mesh)


def _rows(info: dict[str, Any], adapter: bool) -> list[tuple[str, str]]:
    source = info.get("source") or {}
    rows: list[tuple[str, Any]] = []
    fmt = _format(source)
    framework = source.get("framework")
    rows.append(("Source format", f"`{fmt}`" + (f" ({framework})" if framework else "") if fmt else "unknown"))
    where = _short_path(source.get("path"))
    if where or source.get("step") is not None:
        text = f"`{where}`" if where else ""
        if source.get("step") is not None:
            text += f" (step {source['step']})" if text else f"step {source['step']}"
        rows.append(("Source checkpoint", text))
    if source.get("role"):
        rows.append(("Role", source["role"]))
    if source.get("world_size") is not None or source.get("mesh"):
        mesh = _mesh_text(source.get("mesh"), source.get("mesh_dim_names"))
        ws = source.get("world_size")
        parts = [str(ws)] if ws is not None else []
        parts += [f"`{mesh}`"] if mesh else []
        rows.append(("World size / mesh", " / ".join(parts)))
    if info.get("architecture"):
        rows.append(("Architecture", f"`{info['architecture']}`"))
    base_raw = info.get("base_model")
    base = _hub_model_id(base_raw)
    if base:
        rows.append(("Base model", f"[{base}](https://huggingface.co/{base})"))
    elif base_raw:
        local_name = (_short_path(str(base_raw)) or "").split("/")[-1]
        rows.append(("Base model", f"`{local_name}` (a local path, not a Hub id: not linked)"))
    else:
        rows.append(("Base model", "unknown (the config has no `_name_or_path`; merge with `--base-model-name ORG/NAME`)"))
    lora = info.get("lora") or {}
    dtype_text = _dtype_text(info, adapter)
    if dtype_text:
        rows.append(("dtype", dtype_text))
    if lora:
        how = _LORA_MODES.get(str(lora.get("mode")), str(lora.get("mode")))
        if (gguf := _gguf(info)) and gguf.get("lora_file") and not adapter:
            how = {"adapter": "written as a llama.cpp GGUF LoRA file",
                   "both": "fused into the weights, and written as a llama.cpp GGUF LoRA file"}.get(str(lora.get("mode")), how)
            how += f" `{gguf['lora_file']}`"
        details = [f"r={lora.get('r')}", f"lora_alpha={lora.get('lora_alpha')}"]
        if lora.get("use_rslora"):
            details.append("rsLoRA")
        if lora.get("target_modules"):
            details.append("modules: " + ", ".join(f"`{m}`" for m in lora["target_modules"]))
        if lora.get("target_parameters"):
            details.append("parameters: " + ", ".join(f"`{m}`" for m in lora["target_parameters"]))
        if lora.get("adapter_dtype") and lora.get("mode") == "both" and not adapter and not _gguf(info):
            details.append(f"adapter in `{lora.get('adapter_subfolder') or _ADAPTER_SUBFOLDER}/`, `{lora['adapter_dtype']}`")
        rows.append(("LoRA", f"{how} ({'; '.join(details)})"))
    quant = info.get("quantization")
    if quant:
        rows.append(("Quantization", f"{quant.get('method')} `{quant.get('mode')}`"))
    missing = info.get("missing_files") or []
    if missing:
        what = {"tokenizer": "no tokenizer (use the base model's, or merge with `--config DIR` holding it)"}
        rows.append(("Not included", "; ".join(what.get(m, f"no `{m}`") for m in missing)))
    verification = info.get("verification")
    if verification is None:
        rows.append(("Verification", "not run"))
    else:
        verdict = "passed" if verification.get("passed") else "**FAILED**"
        summary = verification.get("summary")
        rows.append(("Verification", f"{verdict}: {summary}" if summary else verdict))
    rows.append(("Merged with", f"hf-merge {info.get('hf_merge_version') or '(unknown version)'}"))
    return [(k, _cell(v)) for k, v in rows]


def _dtype_text(info: dict[str, Any], adapter: bool) -> str | None:
    """The written dtype; bitsandbytes modes; how to get a half-size copy of a float32 model."""
    lora = info.get("lora") or {}
    dtype = lora.get("adapter_dtype") if adapter and lora.get("adapter_dtype") else info.get("dtype")
    if not dtype:
        return None
    if dtype == "auto":
        return "as stored in the checkpoint"
    gguf = _gguf(info)
    counts = (gguf or {}).get("tensor_counts", {}).get((gguf or {}).get("file"))
    if counts and not adapter:  # what the file holds: 1-D tensors (norms, biases) stay F32 whatever the type
        return f"GGUF `{dtype}`: " + ", ".join(f"{count(n, 'tensor')} `{t}`" for t, n in counts.items())
    quant = info.get("quantization")
    if quant and not adapter:
        return f"`{quant.get('mode')}` weights ({quant.get('method')}), other tensors `{dtype}`"
    if dtype == "float32" and not adapter:
        return "`float32` (exact; merge with `--dtype bfloat16` for a half-size copy, one rounding per weight)"
    return f"`{dtype}`"
def _gguf(info: dict[str, Any]) -> dict[str, Any] | None:
    """The GGUF record of a ``merge --gguf`` folder (``{"file", "type", ...}``), else None."""
    gguf = info.get("gguf")
    return gguf if isinstance(gguf, dict) and gguf.get("file") else None


def _gguf_adapter(info: dict[str, Any]) -> bool:
    """The folder holds a llama.cpp GGUF LoRA file alone (``merge --lora adapter --gguf``)."""
    gguf = _gguf(info)
    return bool(gguf and gguf.get("lora_file") and gguf["lora_file"] == gguf["file"])


def _gguf_snippet(gguf: dict[str, Any], repo_id: str | None) -> str:
    file = gguf["file"]
    if gguf.get("lora_file") == file:  # an adapter: applied to the base model's GGUF file
        return "\n".join([
            f"# llama.cpp: llama-cli -m BASE_MODEL.gguf --lora {file} -p \"Hello\"",
            "from llama_cpp import Llama  # pip install llama-cpp-python",
            "",
            f'llm = Llama(model_path="BASE_MODEL.gguf", lora_path="{file}")',
            'print(llm("Hello", max_tokens=32)["choices"][0]["text"])',
        ])
    if repo_id:
        return "\n".join([
            f"# llama.cpp: llama-cli -hf {repo_id} -p \"Hello\"   (or: llama-cli -m {file})",
            "from llama_cpp import Llama  # pip install llama-cpp-python",
            "",
            f'llm = Llama.from_pretrained(repo_id="{repo_id}", filename="{file}")',
            'print(llm("Hello", max_tokens=32)["choices"][0]["text"])',
        ])
    return "\n".join([
        f"# llama.cpp: llama-cli -m {file} -p \"Hello\"",
        "from llama_cpp import Llama  # pip install llama-cpp-python",
        "",
        f'llm = Llama(model_path="{file}")',
        'print(llm("Hello", max_tokens=32)["choices"][0]["text"])',
    ])


def _snippet(info: dict[str, Any], repo_id: str | None, folder_files: set[str], adapter: bool) -> str:
    if (gguf := _gguf(info)) and not adapter:
        return _gguf_snippet(gguf, repo_id)
    model_id = repo_id or "path/or/repo-id"
    auto_class, _ = _arch_task(info.get("architecture"))
    has_tokenizer = any(name in folder_files for name in _TOKENIZER_FILES)
    quant = info.get("quantization")
    lora = info.get("lora") or {}
    lines: list[str] = []
    if adapter:
        base = _hub_model_id(info.get("base_model")) or "BASE_MODEL_ID"
        lines += [
            "from peft import PeftModel",
            f"from transformers import {auto_class}",
            "",
            f'base = {auto_class}.from_pretrained("{base}")',
            f'model = PeftModel.from_pretrained(base, "{model_id}")',
        ]
        return "\n".join(lines)
    imports = [auto_class] + (["AutoTokenizer"] if has_tokenizer else [])
    lines.append(f"from transformers import {', '.join(imports)}")
    lines.append("")
    if quant:
        lines.append(f"# needs `pip install bitsandbytes`; the weights are stored {quant.get('mode')}-quantized")
    lines.append(f'model = {auto_class}.from_pretrained("{model_id}")')
    if has_tokenizer:
        lines.append(f'tokenizer = AutoTokenizer.from_pretrained("{model_id}")')
    if lora.get("mode") == "both":
        sub = lora.get("adapter_subfolder") or _ADAPTER_SUBFOLDER
        base = _hub_model_id(info.get("base_model")) or "BASE_MODEL_ID"
        lines += [
            "",
            f"# the LoRA adapter alone, in the `{sub}/` folder:",
            "from peft import PeftModel",
            f'base = {auto_class}.from_pretrained("{base}")',
            f'adapted = PeftModel.from_pretrained(base, "{model_id}", subfolder="{sub}")',
        ]
    return "\n".join(lines)


def _summary(info: dict[str, Any], adapter: bool) -> str:
    source = info.get("source") or {}
    what = "This LoRA adapter was" if adapter else "These weights were"
    framework = source.get("framework")
    backend = _backend_tag(source)
    # a format named after its framework ("colossalai colossalai") is said once
    same = bool(framework and backend and backend.lower() == str(framework).lower())
    origin = framework if same else " ".join(x for x in (framework, backend) if x)
    if _gguf(info) and not adapter:
        what = f"This GGUF file (`{_gguf(info)['file']}`, for llama.cpp) was"
        if _gguf_adapter(info):
            what = f"This LoRA adapter, a llama.cpp GGUF LoRA file (`{_gguf(info)['file']}`, for `--lora`), was"
    if _from_hf_folder(source):
        return f"{what} written from a Hugging Face model folder by hf-merge."
    origin_text = f"a {origin} training checkpoint" if origin else "a distributed training checkpoint"
    into = "GGUF" if _gguf(info) and not adapter else "the Hugging Face format"
    return f"{what} merged from {origin_text} into {into} by hf-merge."


def _shown(recorded: str) -> str:
    """A recorded digest as the card shows it: with its kind (a bare one is a sha256)."""
    from ..write.digest import kind_of

    return f"sha256:{recorded}" if kind_of(recorded) == "sha256" else recorded


def _section(info: dict[str, Any], repo_id: str | None, folder_files: set[str], adapter: bool) -> str:
    import jinja2

    files = sorted((str(k), _shown(str(v))) for k, v in (info.get("files") or {}).items())
    env = jinja2.Environment(keep_trailing_newline=True, autoescape=False, trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(_SECTION_TEMPLATE)
    return template.render(
        begin=SECTION_BEGIN,
        end=SECTION_END,
        summary=_summary(info, adapter),
        rows=_rows(info, adapter),
        files=files,
        snippet=_snippet(info, repo_id, folder_files, adapter),
    )


def _title(info: dict[str, Any], repo_id: str | None, adapter: bool) -> str:
    if repo_id:
        return repo_id.split("/")[-1]
    base = _hub_model_id(info.get("base_model"))
    if base:
        return f"{base.split('/')[-1]} ({'LoRA adapter' if adapter or _gguf_adapter(info) else 'fine-tuned'})"
    return info.get("architecture") or ("LoRA adapter" if adapter else "Merged model")


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------
def _render(
    info: dict[str, Any],
    repo_id: str | None,
    existing_card_text: str | None,
    folder_files: Iterable[str] | None,
    *,
    adapter: bool,
) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    fields = _card_fields(info, adapter)
    names = set(folder_files) if folder_files is not None else set(info.get("files") or {})
    section = _section(info, repo_id, names, adapter)
    if existing_card_text is None:
        card = ModelCard.from_template(
            ModelCardData(**fields),
            template_str=_CARD_TEMPLATE,
            title=_title(info, repo_id, adapter),
            section=section,
        )
        return str(card)
    return _extend(existing_card_text, fields, section)


def _extend(existing: str, fields: dict[str, Any], section: str) -> str:
    """Add hf_merge's fields and section to an existing card without overwriting anything."""
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    if REGEX_YAML_BLOCK.search(existing):
        card = ModelCard(existing, ignore_metadata_errors=True)
    else:  # no front matter at all: the whole text is the body
        card = ModelCard(f"---\n{{}}\n---\n{existing}", ignore_metadata_errors=True)
    data: ModelCardData = card.data

    if data.get("library_name") is None:
        data.library_name = fields["library_name"]
    ours_base = fields.get("base_model")
    if ours_base and not data.get("base_model"):
        data.base_model = ours_base
    if ours_base and data.get("base_model_relation") is None and data.get("base_model") == ours_base:
        data.base_model_relation = fields["base_model_relation"]
    existing_tags = data.get("tags") or []
    if isinstance(existing_tags, str):
        existing_tags = [existing_tags]
    data.tags = _unique([str(t) for t in existing_tags] + fields["tags"])
    if data.get("pipeline_tag") is None and fields.get("pipeline_tag"):
        data.pipeline_tag = fields["pipeline_tag"]

    text = card.text
    begin, end = text.find(SECTION_BEGIN), text.find(SECTION_END)
    if begin != -1 and end > begin:  # a previous run's section: replace it in place
        text = text[:begin] + section.rstrip("\n") + text[end + len(SECTION_END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section if text.strip() else "\n" + section
    card.text = text
    return str(card)
