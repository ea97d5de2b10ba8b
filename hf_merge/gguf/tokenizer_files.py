"""A tokenizer folder's JSON files, each read and parsed once, and what llama.cpp's
``gguf.SpecialVocab`` makes of them.

``tokenizer.json`` (the large one: 11 MB for Qwen2's 151,936 tokens) is read as text once and
decoded once; the vocabulary, added tokens and merges all come from that one parse, and the
``tokenizers.Tokenizer`` (for the pre-tokenizer hash) is built from the same text.

:func:`special_vocab` keeps llama.cpp's own rules for special token ids, add-bos/eos flags and
the chat template (``gguf.SpecialVocab``, public API) but gives it a folder whose
``tokenizer.json`` holds only what those rules read (added tokens, post-processor: no vocabulary,
no merges), next to copies of the small files it reads; the merges, converted as it converts
them, come from the parse already made.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MappingError

# What gguf.SpecialVocab reads besides tokenizer.json (gguf 0.19.0, vocab.py): special ids and
# add_* flags from tokenizer_config.json and config.json, the chat template from
# tokenizer_config.json, chat_template.jinja (+ additional_chat_templates/) or chat_template.json.
_SPECIAL_VOCAB_FILES = ("tokenizer_config.json", "config.json", "chat_template.jinja", "chat_template.json")
_SPECIAL_VOCAB_DIRS = ("additional_chat_templates",)


def read_json(path: Path, text: str | None = None) -> dict:
    """``path`` (or its already-read ``text``) as a JSON object; anything else is a MappingError."""
    try:
        value = json.loads(path.read_text(encoding="utf-8") if text is None else text)
    except (ValueError, UnicodeDecodeError) as e:
        raise MappingError(f"{path} is not valid JSON ({str(e)[:120]}); fix or delete it") from None
    if not isinstance(value, dict):
        raise MappingError(f"{path} is not a JSON object; fix or delete it")
    return value


@dataclass
class TokenizerFiles:
    """``tokenizer.json`` (text and parsed; None when absent) and ``tokenizer_config.json``
    (parsed; empty when absent) of ``folder``."""

    folder: Path
    text: str | None
    data: dict[str, Any] | None
    config: dict[str, Any]

    @classmethod
    def read(cls, folder: Path) -> "TokenizerFiles":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        text = path.read_text(encoding="utf-8") if path.is_file() else None
        data = read_json(path, text) if text is not None else None
        config_path = folder / "tokenizer_config.json"
        config = read_json(config_path) if config_path.is_file() else {}
        return cls(folder, text, data, config)


def gguf_merges(merges: Any) -> list[str]:
    """``tokenizer.json``'s ``model.merges`` as GGUF's ``"a b"`` strings, as ``gguf.SpecialVocab``
    converts them: the list-of-pairs format (transformers >= 4.45) joined by a space, a space
    inside a part written as ``U+0120`` (``chr(ord(" ") + 256)``)."""
    if not isinstance(merges, list) or not merges:
        return []
    if isinstance(merges[0], str):
        return merges
    if isinstance(merges[0], list) and len(merges[0]) == 2 and isinstance(merges[0][0], str):
        return [" ".join(part.replace(" ", "\u0120") for part in pair) for pair in merges]
    raise MappingError("tokenizer.json has merges in an unknown format (neither 'a b' strings nor [a, b] pairs)")


def special_vocab(files: TokenizerFiles, n_vocab: int, merges: list[str] | None = None):
    """``gguf.SpecialVocab`` of ``files.folder`` (special ids, add-bos/eos flags, chat template;
    ``merges`` set as given) without it parsing the large ``tokenizer.json`` again."""
    import gguf

    with tempfile.TemporaryDirectory(prefix="hf-merge-vocab-") as tmp:
        for name in _SPECIAL_VOCAB_FILES:
            if (files.folder / name).is_file():
                shutil.copyfile(files.folder / name, Path(tmp) / name)
        for name in _SPECIAL_VOCAB_DIRS:
            if (files.folder / name).is_dir():
                shutil.copytree(files.folder / name, Path(tmp) / name)
        if files.data is not None:
            slim = {**files.data, "model": {}}  # never empty: SpecialVocab treats an empty one as absent
            (Path(tmp) / "tokenizer.json").write_text(json.dumps(slim), encoding="utf-8")
        special = gguf.SpecialVocab(tmp, load_merges=False, n_vocab=n_vocab)
    if merges:
        special.merges = merges
    return special
