"""Checks on paths, flags and targets that need no torch: run before anything heavy is imported.

A typo in a path should cost a fraction of a second, not the ~1.5 s of importing torch and the
readers. These checks only look at the file system and at option values; the readers repeat
them (with more detail) when the library is called without going through here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import QuantizationError, SourceNotFoundError
from .readers.formats import check_name
from .write.atomic import check_apart, check_target, holds_side_files_only

QUANTIZE_MODES = ("nf4", "fp4", "int8")
INSTALL_HINT = "pip install 'hf-merge[quantize]' (or: pip install bitsandbytes)"


def check_folder(path: "str | Path", what: str, hint: str) -> Path:
    """``path`` must be an existing folder; else a one-line :class:`SourceNotFoundError`."""
    path = Path(path)
    if not path.exists():
        raise SourceNotFoundError(f"{path} does not exist; {hint}")
    if not path.is_dir():
        raise SourceNotFoundError(f"{path} is a file; {what} must be a folder ({hint})")
    return path


def check_merge(
    source: "str | Path",
    target: "str | Path",
    *,
    overwrite: bool = False,
    backend: str = "auto",
    config: "str | Path | None" = None,
    base_model: "str | Path | None" = None,
    quantize: object = None,
) -> None:
    """Everything about a merge's inputs that can be refused without reading a tensor."""
    check_name(backend)
    check_folder(source, "SOURCE", "pass the checkpoint's actor/ or global_step_N folder")
    if config is not None:
        check_folder(config, "--config", "pass the folder holding config.json and the tokenizer")
    if base_model is not None:
        check_folder(base_model, "--base-model", "pass the base model's Hugging Face folder")
    check_apart(source, target)
    # verl scripts merge into actor/huggingface (config and tokenizer only): filled in place
    check_target(Path(target), overwrite=overwrite or holds_side_files_only(Path(target)))
    if isinstance(quantize, str):
        if quantize not in QUANTIZE_MODES:
            raise QuantizationError(f"unknown --quantize mode {quantize!r}; use nf4, fp4 or int8")
    if quantize is not None and importlib.util.find_spec("bitsandbytes") is None:
        raise QuantizationError(f"--quantize needs bitsandbytes, which is not installed: {INSTALL_HINT}")


def check_verify(target: "str | Path", against: "str | Path | None", *, config: "str | Path | None" = None,
                 base_model: "str | Path | None" = None) -> None:
    """``hf-merge verify``: both folders exist (and the optional ones)."""
    check_folder(target, "TARGET", "pass the merged Hugging Face folder")
    if against is not None:
        check_folder(against, "--against", "pass the source checkpoint or a reference Hugging Face folder")
    if config is not None:
        check_folder(config, "--config", "pass the folder holding config.json and the tokenizer")
    if base_model is not None:
        check_folder(base_model, "--base-model", "pass the base model's Hugging Face folder")
