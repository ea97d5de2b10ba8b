"""The GGUF vocabulary step: one parse of ``tokenizer.json`` and packed metadata, to the same bytes.

``load_vocab`` builds a byte-level BPE vocabulary from the parsed ``tokenizer.json`` (no
transformers) and ``write_file`` packs the metadata arrays whole; the reference is the way
llama.cpp's converter reads a folder, kept in ``transformers_bpe_vocab``: ``AutoTokenizer`` +
``gguf.SpecialVocab`` on the folder, written by the ``gguf`` package's own ``GGUFWriter``. The
GGUF headers must be byte-identical for every tokenizer kind the suite has: llama.cpp's own GPT-2
vocabulary (GPT2Tokenizer), the fixtures' byte-level BPE (Qwen2 checkpoints), and a SentencePiece
Llama-2 tokenizer. (The real Qwen2 tokenizer, 11 MB, is checked the same way by
``benchmarks/check_gguf_vocab.py``, with llama.cpp's other vocabularies.)
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf", reason="GGUF output needs pip install 'hf-merge[gguf]'")

from hf_merge.gguf import bpe_vocab  # noqa: E402
from hf_merge.gguf.kv import kv_bytes, writer_class  # noqa: E402
from hf_merge.gguf.tokenizer import add_to_writer, load_vocab, sentencepiece_vocab  # noqa: E402
from hf_merge.gguf.vocab import check_text  # noqa: E402
from hf_merge.gguf.tokenizer_files import TokenizerFiles  # noqa: E402
from hf_merge.gguf.writer import write_file  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory) -> Path:
    """llama.cpp's ggml-vocab-gpt-2.gguf rebuilt by transformers (tests/data/gguf_gpt2_tokenizer)."""
    folder = tmp_path_factory.mktemp("gpt2-tok")
    shutil.copy(DATA / "gguf_gpt2_tokenizer" / "tokenizer_config.json", folder)
    (folder / "tokenizer.json").write_bytes(gzip.decompress((DATA / "gguf_gpt2_tokenizer" / "tokenizer.json.gz").read_bytes()))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return folder


def _case(request, kind: str) -> tuple[Path, int, str | None]:
    """(folder, model vocab size, --gguf-pre-tokenizer) of each tokenizer kind."""
    if kind == "gpt2":
        return request.getfixturevalue("gpt2_folder"), 50304, None
    if kind == "qwen2-fixture":  # its pre-tokenizer hash is unknown to llama.cpp: the override
        return request.getfixturevalue("qwen2_fp32_ws2").hf_dir, 256, "gpt-2"
    return request.getfixturevalue("llama_sp_folder"), 416, None


def _reference_vocab(folder: Path, size: int, pre: str | None):
    """The previous code's vocabulary: transformers + gguf.SpecialVocab reading the folder."""
    if (folder / "tokenizer.model").is_file():
        vocab = sentencepiece_vocab(TokenizerFiles.read(folder), size)
        vocab.special = gguf.SpecialVocab(folder, load_merges=False, n_vocab=size)
        return vocab
    return bpe_vocab.transformers_bpe_vocab(folder, size, pre)


def _keys(vocab):
    def add(writer) -> None:
        writer.add_type("model")
        writer.add_name("vocab-test")
        add_to_writer(writer, vocab)

    return add


def _stock_header(vocab, path: Path) -> bytes:
    writer = gguf.GGUFWriter(path, "llama")
    _keys(vocab)(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path.read_bytes()


# GPT-2's 50,257 tokens take seconds both ways: make test-slow (make test keeps the BPE and SentencePiece cases)
@pytest.mark.parametrize("kind", [pytest.param("gpt2", marks=pytest.mark.slow), "qwen2-fixture", "sentencepiece"])
def test_header_equals_the_transformers_way(kind, request, tmp_path, monkeypatch):
    """Every key (tokens, types, scores, merges, special ids, add-bos/eos, chat template, pre) of
    the file ``write_file`` writes from ``load_vocab`` equals, byte for byte, the previous way's
    file; and the new way never touched transformers."""
    folder, size, pre = _case(request, kind)
    expected = _stock_header(_reference_vocab(folder, size, pre), tmp_path / "old.gguf")

    def refuse(*args, **kwargs):
        raise AssertionError("load_vocab went through transformers")

    monkeypatch.setattr(bpe_vocab, "transformers_bpe_vocab", refuse)
    vocab = load_vocab(folder, size, pre_tokenizer=pre)
    write_file(None, tmp_path / "new.gguf", "llama", [], _keys(vocab))
    assert (tmp_path / "new.gguf").read_bytes() == expected
    fields = gguf.GGUFReader(tmp_path / "new.gguf").fields
    assert len(fields["tokenizer.ggml.tokens"].data) == size
    if kind != "sentencepiece":
        assert len(fields["tokenizer.ggml.merges"].data) > 0
    if kind == "gpt2":
        assert bytes(fields["tokenizer.chat_template"].parts[-1]).decode().startswith("{% for m in messages %}")


def test_tokenizers_ids_equal_transformers_for_the_hash_text(gpt2_folder, qwen2_fp32_ws2):
    """The pre-tokenizer hash is taken from ``tokenizers.Tokenizer`` built from tokenizer.json: on
    llama.cpp's fixed text it gives the ids transformers' AutoTokenizer gives (GPT2Tokenizer and
    the class transformers picks for the Qwen2 fixture rebuild their own pipelines)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    for folder in (gpt2_folder, qwen2_fp32_ws2.hf_dir):
        ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(check_text()).ids
        assert ids == AutoTokenizer.from_pretrained(folder).encode(check_text()), folder


def _edited(folder: Path, dest: Path, config: dict | None = None, added: dict | None = None) -> Path:
    shutil.copytree(folder, dest)
    if config:
        path = dest / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if added:
        data = json.loads((dest / "tokenizer.json").read_text())
        data["added_tokens"] = [{**e, **added} for e in data["added_tokens"]]
        (dest / "tokenizer.json").write_text(json.dumps(data))
    return dest


def test_transformers_way_where_it_reads_the_folder_differently(gpt2_folder, tmp_path):
    """Where transformers would add or change tokens the JSON way would miss, ``load_vocab`` takes
    the transformers way: a special token named only in tokenizer_config.json (transformers
    appends it at id 50257), an added token named as a special token but not marked special."""
    files = lambda folder: TokenizerFiles.read(folder)  # noqa: E731
    named = _edited(gpt2_folder, tmp_path / "named", config={"additional_special_tokens": ["<|im_end|>"]})
    assert bpe_vocab.json_bpe_vocab(files(named), 50304) is None
    vocab = load_vocab(named, 50304)
    assert (vocab.tokens[50257], vocab.types[50257]) == ("<|im_end|>", int(gguf.TokenType.CONTROL))

    not_special = _edited(gpt2_folder, tmp_path / "not-special", added={"special": False})
    assert bpe_vocab.json_bpe_vocab(files(not_special), 50304) is None
    assert bpe_vocab.json_bpe_vocab(files(gpt2_folder), 50304) is not None


def test_unknown_hash_keeps_the_transformers_error(qwen2_fp32_ws2):
    """Without --gguf-pre-tokenizer, a hash llama.cpp does not know goes the transformers way, which
    raises the error that names the option."""
    from hf_merge.errors import MappingError

    assert bpe_vocab.json_bpe_vocab(TokenizerFiles.read(qwen2_fp32_ws2.hf_dir), 256) is None
    with pytest.raises(MappingError, match="unknown to llama.cpp.*--gguf-pre-tokenizer"):
        load_vocab(qwen2_fp32_ws2.hf_dir, 256)


def test_kv_bytes_equal_the_gguf_writers(tmp_path):
    """``kv_bytes`` packs every value type as ``GGUFWriter.write_kv_data_to_file`` does: scalars of
    each width, bools, strings (UTF-8, bytes), arrays of ints, floats, bools, strings and nested
    arrays; an array of mixed types is refused the same way."""
    def fill(writer) -> None:
        writer.add_uint8("u8", 255), writer.add_int8("i8", -128), writer.add_uint16("u16", 65535)
        writer.add_int16("i16", -3), writer.add_uint32("u32", 2**32 - 1), writer.add_int32("i32", -(2**31))
        writer.add_uint64("u64", 2**64 - 1), writer.add_int64("i64", -(2**63)), writer.add_float32("f32", 0.1)
        writer.add_float64("f64", 0.1), writer.add_bool("b", False), writer.add_string("s", "héllo 🦙")
        writer.add_array("ints", [1, -2, 3] * 100), writer.add_array("floats", [0.1, -1e-30, 3.4e38])
        writer.add_array("bools", [True, False, True]), writer.add_array("strs", ["a", "", "日本語", "x y"] * 50)
        writer.add_array("bytes", [b"\x00\xff", bytearray(b"ab")]), writer.add_array("nested", [[1, 2], ["a"], [[0.5]]])
        writer.add_key_value("typed", [1, 2, 3], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT16)
        writer.add_key_value("raw", b"\x01\x02", gguf.GGUFValueType.ARRAY)
        writer.add_key_value("raw32", bytearray(b"\x01\x02"), gguf.GGUFValueType.ARRAY)

    expected = gguf.GGUFWriter(tmp_path / "a.gguf", "llama")
    fill(expected)
    expected.write_header_to_file()
    expected.write_kv_data_to_file()
    expected.close()
    ours = writer_class()(tmp_path / "b.gguf", "llama")
    fill(ours)
    ours.write_header_to_file()
    ours.write_kv_data_to_file()
    ours.close()
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()
    for bad in ([1, "a"], ["a", 1], [1, 2.0], [True, 1]):
        with pytest.raises(ValueError, match="same type"):
            kv_bytes({"k": gguf.GGUFValue(bad, gguf.GGUFValueType.ARRAY)})
