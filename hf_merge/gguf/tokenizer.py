"""The tokenizer of a Hugging Face folder as GGUF ``tokenizer.ggml.*`` keys.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen...) become ``tokenizer.ggml.model = gpt2``:
tokens (padded to the model's vocabulary with ``[PAD<i>]`` UNUSED entries), token types (added
special tokens CONTROL, other added tokens USER_DEFINED), merges, special token ids, add-bos/eos
flags and the chat template (the last three through ``gguf.SpecialVocab``). The pre-tokenizer is
identified as llama.cpp identifies it: the sha256 of the tokenization of a fixed text, looked up
in ``pre_tokenizers.json`` (a table taken from llama.cpp's converter); an unknown hash is an error.
``tokenizer.json`` is read and parsed once (:mod:`.tokenizer_files`); the vocabulary comes from that
parse without transformers wherever transformers would read the folder the same way
(:mod:`.bpe_vocab` says when), else through transformers' ``AutoTokenizer`` as llama.cpp's
converter reads it; both give the same keys.

SentencePiece tokenizers (Llama-2 style: a ``tokenizer.model`` in the folder) become
``tokenizer.ggml.model = llama`` as llama.cpp's converter writes them: every piece with its score
and type (normal, unknown, control, unused, byte) read with the ``sentencepiece`` package, added
tokens from ``added_tokens.json``, ``tokenizer_config.json``'s ``added_tokens_decoder`` and
``tokenizer.json``'s ``added_tokens`` (where transformers 5 keeps them; llama.cpp's converter reads
only the first two, so it misses a token added by transformers 5): control when special, else
user-defined with ``▁`` written as a space; score -1000), ``[PAD<i>]`` UNUSED entries (score -10000)
up to the model's vocabulary, pre-tokenizer ``default``, no merges, ``add_space_prefix`` when the
tokenizer config sets it. A SentencePiece-style ``tokenizer.json`` without its ``tokenizer.model``
is refused with what to do.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import MappingError
from .tokenizer_files import TokenizerFiles, read_json, special_vocab
from .vocab import Vocab, _looks_special

logger = logging.getLogger(__name__)


def load_vocab(folder: Path, vocab_size: int, *, pre_tokenizer: str | None = None) -> Vocab:
    """Read the tokenizer in ``folder`` (never running remote code) for a model of ``vocab_size`` rows."""
    from .bpe_vocab import json_bpe_vocab, transformers_bpe_vocab

    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise MappingError(
            f"no tokenizer in {folder} (tokenizer.json); llama.cpp needs one inside the GGUF: pass --config DIR "
            "with the base model's config.json and tokenizer files"
        )
    files = TokenizerFiles.read(folder)
    if (folder / "tokenizer.model").is_file():
        return sentencepiece_vocab(files, vocab_size)
    vocab = json_bpe_vocab(files, vocab_size, pre_tokenizer)
    if vocab is None:
        logger.debug("%s: reading the tokenizer through transformers", folder)
        vocab = transformers_bpe_vocab(folder, vocab_size, pre_tokenizer)
    return vocab


def _load_sentencepiece(path: Path):
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise MappingError(
            f"{path} is a SentencePiece tokenizer; reading it needs the sentencepiece package: pip install 'hf-merge[gguf]'"
        ) from None
    processor = SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(path.read_bytes())  # parses the protobuf only, runs nothing
    except (RuntimeError, OSError) as e:
        raise MappingError(f"{path} is not a valid SentencePiece model ({str(e).splitlines()[0][:120]})") from None
    return processor


def _piece_type(processor, i: int) -> "gguf.TokenType":
    import gguf

    for test, kind in ((processor.IsUnknown, gguf.TokenType.UNKNOWN), (processor.IsControl, gguf.TokenType.CONTROL),
                       (processor.IsUnused, gguf.TokenType.UNUSED), (processor.IsByte, gguf.TokenType.BYTE)):
        if test(i):
            return kind
    return gguf.TokenType.NORMAL


def sentencepiece_vocab(files: TokenizerFiles, vocab_size: int) -> Vocab:
    """The ``tokenizer.model`` of ``files.folder`` (+ its added tokens) as llama.cpp's ``llama`` vocabulary."""
    import gguf

    folder = files.folder
    processor = _load_sentencepiece(folder / "tokenizer.model")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    if processor.vocab_size() > vocab_size:
        raise MappingError(
            f"the SentencePiece model has {processor.vocab_size()} pieces but the model's vocab_size is {vocab_size}; "
            "pass --config DIR with the tokenizer that belongs to this model"
        )
    for i in range(processor.vocab_size()):
        tokens[i] = processor.IdToPiece(i)
        scores[i] = processor.GetScore(i)
        types[i] = int(_piece_type(processor, i))
    added = {}
    if (folder / "added_tokens.json").is_file():
        added = {t: {"content": t, "special": False, "_id": i} for t, i in read_json(folder / "added_tokens.json").items()}
    config = files.config
    decoder = {int(key): entry for key, entry in (config.get("added_tokens_decoder") or {}).items()}
    if files.data is not None:  # transformers 5 keeps its added tokens in tokenizer.json only
        for entry in files.data.get("added_tokens") or []:
            decoder.setdefault(int(entry["id"]), entry)
    for key, entry in sorted(decoder.items()):
        added[f"#{key}"] = {**entry, "_id": key, "_from_config": True}
    for entry in added.values():
        i, token = entry["_id"], entry["content"]
        if not 0 <= i < vocab_size:
            logger.warning("added token %r has id %d, outside the model's vocabulary of %d; left out", token, i, vocab_size)
            continue
        control = entry.get("_from_config") and (entry.get("special") or _looks_special(token))
        if not control and entry.get("_from_config"):
            token = token.replace("\u2581", " ")  # llama.cpp expects user-defined tokens pre-normalized
        tokens[i], scores[i] = token, -1000.0
        types[i] = int(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
    space_prefix = config.get("add_prefix_space")
    return Vocab("llama", "default", tokens, types, special_vocab(files, vocab_size), scores=scores,
                 add_space_prefix=space_prefix if isinstance(space_prefix, bool) else None)


def add_to_writer(writer, vocab: Vocab) -> None:
    """Add the ``tokenizer.ggml.*`` keys to a ``gguf.GGUFWriter`` (before its header is written)."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    vocab.special.add_to_gguf(writer, quiet=True)
