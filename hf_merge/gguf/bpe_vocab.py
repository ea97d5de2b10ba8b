"""Byte-level BPE tokenizers as GGUF's ``gpt2`` vocabulary, two ways that give the same keys.

- :func:`json_bpe_vocab` (the usual one): everything from the one parse of ``tokenizer.json``
  (``model.vocab``, ``added_tokens``, ``model.merges``) and a ``tokenizers.Tokenizer`` built from
  the same text for the pre-tokenizer hash. It answers None wherever transformers could read the
  folder differently, and the caller then takes the second way: the model is not a byte-level BPE
  (ByteLevel decoder, no byte fallback); ``tokenizer_config.json`` names a special token that is
  not a special added token of ``tokenizer.json``, or lists an added token that differs from it
  (transformers would add or change it); an added token id is also another string's id; an added
  token that is not normalized does not encode to itself alone; no merges; or, without
  ``--gguf-pre-tokenizer``, the hash of the fixed text's ids is not in llama.cpp's table
  (transformers 5 may rebuild a tokenizer class's own pre-tokenizer rather than
  ``tokenizer.json``'s; llama.cpp's table was made from ``tokenizer.json``'s).
- :func:`transformers_bpe_vocab`: what llama.cpp's converter does, through transformers'
  ``AutoTokenizer`` (seconds to import and build for a 150k vocabulary) and ``gguf.SpecialVocab``
  reading the folder itself.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ..errors import MappingError
from .vocab import Vocab, _looks_special, check_text, ids_hash, known_pre_tokenizer, pre_tokenizer_name
from .tokenizer_files import TokenizerFiles, gguf_merges, special_vocab

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _named_specials(config: dict[str, Any]) -> list[str]:
    """The special tokens ``tokenizer_config.json`` names (transformers adds any it lacks)."""
    names: list[Any] = [config.get(key) for key in _SPECIAL_KEYS]
    names += list(config.get("additional_special_tokens") or [])
    extra = config.get("extra_special_tokens") or []
    names += list(extra.values()) if isinstance(extra, dict) else list(extra)
    contents = [n.get("content") if isinstance(n, dict) else n for n in names]
    return [c for c in contents if c is not None]


def _added_flags(entry: dict[str, Any]) -> tuple[Any, bool, bool]:
    special = bool(entry.get("special", False))
    return entry.get("content"), special, bool(entry.get("normalized", not special))


def _plain_added_tokens(files: TokenizerFiles, vocab: dict[str, int]) -> dict[int, dict[str, Any]] | None:
    """``tokenizer.json``'s added tokens by id, or None when transformers could see others."""
    added = files.data.get("added_tokens") or []
    if not isinstance(added, list) or not all(
        isinstance(e, dict) and type(e.get("id")) is int and e["id"] >= 0 and isinstance(e.get("content"), str) for e in added
    ):
        return None  # not what tokenizers writes: transformers says what is wrong
    by_id = {e["id"]: e for e in added}
    if len(by_id) != len(added):
        return None
    ids = {e["content"]: i for i, e in by_id.items()}
    reverse = {i: t for t, i in vocab.items()}
    for i, entry in by_id.items():  # an added token is new, or the model's own token at its own id
        if reverse.get(i, entry["content"]) != entry["content"] or vocab.get(entry["content"], i) != i:
            return None
    for content in _named_specials(files.config):
        if content not in ids or not by_id[ids[content]].get("special"):
            return None
    for key, entry in (files.config.get("added_tokens_decoder") or {}).items():
        if int(key) not in by_id or _added_flags(by_id[int(key)]) != _added_flags(entry):
            return None
    return by_id


def json_bpe_vocab(files: TokenizerFiles, vocab_size: int, pre_tokenizer: str | None = None) -> Vocab | None:
    """The ``gpt2`` vocabulary from the parsed ``tokenizer.json``; None: use :func:`transformers_bpe_vocab`."""
    import gguf
    from tokenizers import Tokenizer

    data, config = files.data, files.config
    model = data.get("model") or {}
    if (model.get("type") != "BPE" or model.get("byte_fallback") or not isinstance(model.get("vocab"), dict)
            or not all(type(i) is int and i >= 0 for i in model["vocab"].values())
            or (data.get("decoder") or {}).get("type") != "ByteLevel"
            or config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")):
        return None
    by_id = _plain_added_tokens(files, model["vocab"])
    if by_id is None:
        return None
    merges = gguf_merges(model.get("merges"))
    if not merges:
        return None
    _check_ids(max([*model["vocab"].values(), *by_id]), vocab_size)
    tokenizer = functools.cache(lambda: Tokenizer.from_str(files.text))
    if pre_tokenizer is None:
        pre = known_pre_tokenizer(ids_hash(tokenizer().encode(check_text()).ids))
        if pre is None:
            return None
    else:
        pre = pre_tokenizer_name(None, pre_tokenizer)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    normal = int(gguf.TokenType.NORMAL)
    for token, i in model["vocab"].items():
        tokens[i], types[i] = token, normal
    for i, entry in by_id.items():
        token = entry["content"]
        if not _added_flags(entry)[2]:  # llama.cpp expects added tokens pre-normalized
            encoded = tokenizer().encode(token, add_special_tokens=False).ids
            if encoded != [i]:
                return None
            token = tokenizer().decode(encoded, skip_special_tokens=False)
        special = entry.get("special") or _looks_special(token)
        tokens[i] = token
        types[i] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    return Vocab("gpt2", pre, tokens, types, special_vocab(files, vocab_size, merges))


def _check_ids(top: int, vocab_size: int) -> None:
    if top >= vocab_size:
        raise MappingError(
            f"the tokenizer has id {top} but the model's vocab_size is {vocab_size}; "
            "pass --config DIR with the tokenizer that belongs to this model"
        )


def transformers_bpe_vocab(folder: Path, vocab_size: int, pre_tokenizer: str | None = None) -> Vocab:
    """The ``gpt2`` vocabulary as llama.cpp's converter reads it: through ``AutoTokenizer`` (never
    running remote code) and ``gguf.SpecialVocab`` on ``folder``."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    if _is_sentencepiece_style(tokenizer):
        raise MappingError(
            f"the tokenizer in {folder} is SentencePiece-style but its tokenizer.model is missing; llama.cpp needs the "
            "pieces' scores from it: copy the base model's tokenizer.model into that folder (or pass --config DIR)"
        )
    vocab: dict[str, int] = tokenizer.get_vocab()
    _check_ids(max(vocab.values()), vocab_size)
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
    special_vocab_ = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    if not special_vocab_.merges:
        raise MappingError(f"the BPE tokenizer in {folder} has no merges; it cannot be written as a GGUF gpt2 tokenizer")
    return Vocab("gpt2", pre, tokens, types, special_vocab_)


def _is_sentencepiece_style(tokenizer) -> bool:
    """A Unigram model, or BPE with byte fallback (what converting a SentencePiece model gives)."""
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    return type(model).__name__ == "Unigram" or bool(getattr(model, "byte_fallback", False))

