"""The tokenizer of a Hugging Face folder as GGUF ``tokenizer.ggml.*`` keys.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen...) become ``tokenizer.ggml.model = gpt2``:
tokens (padded to the model's vocabulary with ``[PAD<i>]`` UNUSED entries), token types (added
special tokens CONTROL, other added tokens USER_DEFINED), merges, special token ids, add-bos/eos
flags and the chat template (the last three through ``gguf.SpecialVocab``). The pre-tokenizer is
identified as llama.cpp identifies it: the sha256 of the tokenization of a fixed text, looked up
in ``pre_tokenizers.json`` (a table taken from llama.cpp's converter); an unknown hash is an error.
SentencePiece tokenizers are refused with what to do.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MappingError

logger = logging.getLogger(__name__)

PRE_TOKENIZERS = Path(__file__).with_name("pre_tokenizers.json")


@functools.lru_cache(maxsize=1)
def _pre_table() -> dict[str, Any]:
    return json.loads(PRE_TOKENIZERS.read_text(encoding="utf-8"))


def known_pre_tokenizers() -> list[str]:
    return sorted({v["name"] for v in _pre_table()["hashes"].values()})


def pre_tokenizer_hash(tokenizer) -> str:
    """llama.cpp's identifier of a BPE pre-tokenizer: sha256 of ``str(tokenizer.encode(check_text))``."""
    ids = tokenizer.encode(_pre_table()["check_text"])
    return hashlib.sha256(str(ids).encode()).hexdigest()


def pre_tokenizer_name(tokenizer, override: str | None = None) -> str:
    """The ``tokenizer.ggml.pre`` name; ``override`` skips the hash rule (it must be a known name)."""
    if override is not None:
        if override not in known_pre_tokenizers() and override != "default":
            raise MappingError(
                f"unknown pre-tokenizer {override!r}; use one llama.cpp knows: {', '.join(known_pre_tokenizers())}"
            )
        return override
    digest = pre_tokenizer_hash(tokenizer)
    entry = _pre_table()["hashes"].get(digest)
    if entry is None:
        raise MappingError(
            f"the tokenizer's pre-tokenizer is unknown to llama.cpp (hash {digest[:16]}…); if you know which one it "
            "is (e.g. it is byte-level BPE with the GPT-2 split rule), pass --gguf-pre-tokenizer NAME "
            "(gpt-2, llama-bpe, qwen2, ...)"
        )
    return entry["name"]


@dataclass
class Vocab:
    """What goes into the GGUF: see :func:`add_to_writer`."""

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    special: Any  # gguf.SpecialVocab


def _is_sentencepiece(folder: Path) -> bool:
    if (folder / "tokenizer.model").is_file():
        return True
    tj = folder / "tokenizer.json"
    if tj.is_file():
        model = json.loads(tj.read_text(encoding="utf-8")).get("model") or {}
        return model.get("type") == "Unigram" or bool(model.get("byte_fallback"))
    return False


def _looks_special(token: str) -> bool:
    return token.startswith("<|") and token.endswith("|>")


def load_vocab(folder: Path, vocab_size: int, *, pre_tokenizer: str | None = None) -> Vocab:
    """Read the tokenizer in ``folder`` (never running remote code) for a model of ``vocab_size`` rows."""
    import gguf
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise MappingError(
            f"no tokenizer in {folder} (tokenizer.json); llama.cpp needs one inside the GGUF: pass --config DIR "
            "with the base model's config.json and tokenizer files"
        )
    if _is_sentencepiece(folder):
        raise MappingError(
            f"the tokenizer in {folder} is SentencePiece (Llama-2 style); GGUF output supports byte-level BPE "
            "tokenizers only for now: convert this model with llama.cpp's convert_hf_to_gguf.py"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    vocab: dict[str, int] = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise MappingError(
            f"the tokenizer has id {max(vocab.values())} but the model's vocab_size is {vocab_size}; "
            "pass --config DIR with the tokenizer that belongs to this model"
        )
    pre = pre_tokenizer_name(tokenizer, pre_tokenizer)
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif token in added:
            if not decoder[i].normalized:  # llama.cpp expects added tokens pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            special = decoder[i].special or _looks_special(token)
            tokens.append(token)
            types.append(int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(token)
            types.append(int(gguf.TokenType.NORMAL))
    special_vocab = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    if not special_vocab.merges:
        raise MappingError(f"the BPE tokenizer in {folder} has no merges; it cannot be written as a GGUF gpt2 tokenizer")
    return Vocab("gpt2", pre, tokens, types, special_vocab)


def add_to_writer(writer, vocab: Vocab) -> None:
    """Add the ``tokenizer.ggml.*`` keys to a ``gguf.GGUFWriter`` (before its header is written)."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    vocab.special.add_to_gguf(writer, quiet=True)
