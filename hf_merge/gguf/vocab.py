"""The GGUF vocabulary record (:class:`Vocab`) and llama.cpp's table of BPE pre-tokenizers.

Shared by the readers of a tokenizer (:mod:`.tokenizer`: SentencePiece and the entry
:func:`~.tokenizer.load_vocab`; :mod:`.bpe_vocab`: byte-level BPE), so neither imports the other back.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MappingError

PRE_TOKENIZERS = Path(__file__).with_name("pre_tokenizers.json")


@functools.lru_cache(maxsize=1)
def _pre_table() -> dict[str, Any]:
    return json.loads(PRE_TOKENIZERS.read_text(encoding="utf-8"))


def known_pre_tokenizers() -> list[str]:
    return sorted({v["name"] for v in _pre_table()["hashes"].values()})


def check_text() -> str:
    """The fixed text llama.cpp tokenizes to identify a BPE pre-tokenizer."""
    return _pre_table()["check_text"]


def ids_hash(ids: list[int]) -> str:
    """llama.cpp's identifier of a BPE pre-tokenizer: sha256 of ``str(ids)``, ids of :func:`check_text`."""
    return hashlib.sha256(str(ids).encode()).hexdigest()


def pre_tokenizer_hash(tokenizer) -> str:
    """:func:`ids_hash` of ``tokenizer.encode(check_text())`` (a transformers tokenizer)."""
    return ids_hash(tokenizer.encode(check_text()))


def known_pre_tokenizer(digest: str) -> str | None:
    """The ``tokenizer.ggml.pre`` name llama.cpp gives the hash ``digest``; None if it has none."""
    entry = _pre_table()["hashes"].get(digest)
    return None if entry is None else entry["name"]


def pre_tokenizer_name(tokenizer, override: str | None = None) -> str:
    """The ``tokenizer.ggml.pre`` name; ``override`` skips the hash rule (it must be a known name)."""
    if override is not None:
        if override not in known_pre_tokenizers() and override != "default":
            raise MappingError(
                f"unknown pre-tokenizer {override!r}; use one llama.cpp knows: {', '.join(known_pre_tokenizers())}"
            )
        return override
    digest = pre_tokenizer_hash(tokenizer)
    name = known_pre_tokenizer(digest)
    if name is None:
        raise MappingError(
            f"the tokenizer's pre-tokenizer is unknown to llama.cpp (hash {digest[:16]}…); if you know which one it "
            "is (e.g. it is byte-level BPE with the GPT-2 split rule), pass --gguf-pre-tokenizer NAME "
            "(gpt-2, llama-bpe, qwen2, ...)"
        )
    return name


@dataclass
class Vocab:
    """What goes into the GGUF: see :func:`add_to_writer`."""

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    special: Any  # gguf.SpecialVocab
    scores: list[float] | None = None  # SentencePiece only
    add_space_prefix: bool | None = None


def _looks_special(token: str) -> bool:
    """Added tokens llama.cpp's converter makes CONTROL even when not marked special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>")))
