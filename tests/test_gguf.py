"""GGUF output (``merge --gguf TYPE``), checked against the Hugging Face model, never against
another GGUF reader's opinion of the file.

Sources are REAL FSDP2 checkpoints (``tests/conftest.py``: tiny Qwen2 trained in fp32, Llama with
tied embeddings trained in bf16 on 4 ranks, a PEFT LoRA run) and Hugging Face folders saved by
transformers itself (Qwen3, Mistral). transformers' own GGUF loader (``from_pretrained(dir,
gguf_file=...)``, which undoes llama.cpp's q/k permutation) must give:
- F32: exactly the logits of the HF model in float32;
- Q8_0 / Q4_0: exactly the logits of the HF model whose weights are replaced by
  ``dequantize(quantize(W))`` computed here from the block formats' definitions (ggml's reference
  quantizers), and the Q8_0 bytes must equal that reference quantization byte for byte;
and the tokenizer it rebuilds from the GGUF must give the HF tokenizer's ids.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest
import torch
from helpers import model_logits, reference_logits

from hf_merge.cli.app import main
from hf_merge.transformers_compat import major_version
from hf_merge.errors import MappingError, QuantizationError
from hf_merge.transformers_compat import dtype_kwargs

gguf = pytest.importorskip("gguf", reason="GGUF output needs pip install 'hf-merge[gguf]'")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"),
              pytest.mark.compat]  # GGUF output also on the transformers 4.57 stack (make test-compat)
TRANSFORMERS_4 = (major_version() or 5) < 5

DATA = Path(__file__).parent / "data"
TEXTS = ["the quick brown fox", "hello world <|im_end|> again", " spaces  and\nnewlines, 123!"]


# ------------------------------------------------------------------------------------------------
# reference block quantizers, written from ggml's definitions (quantize_row_q8_0_ref / q4_0_ref)
# ------------------------------------------------------------------------------------------------


def _roundf(x: torch.Tensor) -> torch.Tensor:  # C roundf: half away from zero
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def ref_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along rows: ``d = amax / 127`` (stored fp16), ``q = roundf(x / d)`` (int8)."""
    blocks = w.float().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return d.half(), _roundf(blocks * inv).to(torch.int8)


def ref_q8_0_bytes(w: torch.Tensor) -> bytes:
    d, q = ref_q8_0(w)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=1).numpy().tobytes()


def ref_dequant(w: torch.Tensor, kind: str) -> torch.Tensor:
    """``dequantize(quantize(w))`` for Q8_0 or Q4_0 (Q4_0: ``d = max / -8`` with the signed value of
    largest magnitude, ``q = min(15, trunc(x / d + 8.5))``, value ``(q - 8) * d``)."""
    if kind == "q8_0":
        d, q = ref_q8_0(w)
        return (q.float() * d.float()).reshape(w.shape)
    blocks = w.float().reshape(-1, 32)
    idx = blocks.abs().argmax(dim=1, keepdim=True)
    d = blocks.gather(1, idx) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(blocks * inv + 8.5).clamp(0, 15)
    return ((q - 8) * d.half().float()).reshape(w.shape)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def to_gguf(source: Path, target: Path, kind: str, *extra: str) -> Path:
    """In-process ``hf-merge merge SOURCE TARGET --gguf KIND``; returns the .gguf file."""
    rc = main(["-q", "merge", str(source), str(target), "--gguf", kind, *extra])
    assert rc == 0
    files = list(target.glob("*.gguf"))
    assert len(files) == 1, files
    return files[0]


def gguf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **dtype_kwargs(torch.float32))
    except ValueError as e:  # an older transformers' GGUF loader (the oracle) lacks the architecture
        if "is not supported yet" in str(e):
            pytest.skip(f"transformers' GGUF loader cannot read it back: {e}")
        raise
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


def quantized_reference_logits(hf_dir: Path, input_ids: torch.Tensor, kind: str) -> torch.Tensor:
    """The HF model in float32 with every matrix GGUF quantizes replaced by dequantize(quantize(W))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, **dtype_kwargs(torch.float32))
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "norm" not in name:
                p.copy_(ref_dequant(p, kind))
        return model(input_ids).logits.float()


@pytest.fixture(scope="session")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="session")
def qwen2_q8(qwen2_fp32_ws2, gguf_dir) -> Path:
    return to_gguf(qwen2_fp32_ws2.root, gguf_dir / "qwen2-q8", "q8_0", "--gguf-pre-tokenizer", "gpt-2")


# ------------------------------------------------------------------------------------------------
# model tensors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2_fp32_ws2", "llama_tied_bf16_ws4"])
def test_f32_logits_equal_hf_model(name, checkpoint, gguf_dir):
    """FSDP2 checkpoint -> F32 GGUF: transformers' GGUF loader gives the HF model's logits exactly
    (Llama: q/k permuted to llama.cpp's layout and back; tied: no output.weight)."""
    ck = checkpoint(name)
    path = to_gguf(ck.root, gguf_dir / f"{name}-f32", "f32", "--gguf-pre-tokenizer", "gpt-2")
    ids, _ = reference_logits(ck)
    want = model_logits(ck.reference, ids, dtype=torch.float32)
    assert torch.equal(gguf_logits(path, ids), want)
    names = [t.name for t in gguf.GGUFReader(path).tensors]
    assert ("output.weight" in names) is (not ck.options["tie_word_embeddings"])
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in gguf.GGUFReader(path).tensors)


def test_llama_qk_rows_are_permuted(llama_tied_bf16_ws4, gguf_dir):
    """The permutation is really there: attn_q rows are HF's rows interleaved per head."""
    path = to_gguf(llama_tied_bf16_ws4.root, gguf_dir / "llama-perm", "f32", "--gguf-pre-tokenizer", "gpt-2")
    from safetensors.torch import load_file

    hf = load_file(next(Path(llama_tied_bf16_ws4.reference).glob("*.safetensors")))
    q = hf["model.layers.0.self_attn.q_proj.weight"].float()
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    got = torch.from_numpy(tensors["blk.0.attn_q.weight"].data.copy()).reshape(q.shape)
    heads, hd = 4, q.shape[0] // 4
    assert torch.equal(got[1], q[hd // 2])  # row 1 of head 0 is HF's row d/2 (its rotation partner)
    assert not torch.equal(got, q)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_logits_equal_hf_with_dequantized_weights(kind, qwen2_fp32_ws2, qwen2_q8, gguf_dir):
    path = qwen2_q8 if kind == "q8_0" else to_gguf(
        qwen2_fp32_ws2.root, gguf_dir / "qwen2-q4", kind, "--gguf-pre-tokenizer", "gpt-2"
    )
    ids, _ = reference_logits(qwen2_fp32_ws2)
    assert torch.equal(gguf_logits(path, ids), quantized_reference_logits(qwen2_fp32_ws2.reference, ids, kind))


def test_q8_0_bytes_equal_reference_quantization(qwen2_fp32_ws2, qwen2_q8):
    from safetensors.torch import load_file

    hf = load_file(next(Path(qwen2_fp32_ws2.reference).glob("*.safetensors")))
    tensors = {t.name: t for t in gguf.GGUFReader(qwen2_q8).tensors}
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight", "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight"}
    for gname, hname in pairs.items():
        t = tensors[gname]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0, gname
        assert t.data.tobytes() == ref_q8_0_bytes(hf[hname]), gname
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.attn_q.bias"].tensor_type == gguf.GGMLQuantizationType.F32


def test_row_chunks_give_the_same_bytes(qwen2_fp32_ws2, qwen2_q8, gguf_dir, monkeypatch):
    """Quantizing one row at a time (the streaming path at its smallest) writes the same file."""
    from hf_merge.gguf import quant

    monkeypatch.setattr(quant, "CHUNK_BYTES", 1)
    path = to_gguf(qwen2_fp32_ws2.root, gguf_dir / "qwen2-q8-rows", "q8_0", "--gguf-pre-tokenizer", "gpt-2")
    assert path.read_bytes() == qwen2_q8.read_bytes()


def test_lora_fused_and_gguf_lora_file(lora_ckpt, gguf_dir):
    """A PEFT LoRA checkpoint (default --lora both): the fused model, whose logits equal PEFT's
    merge_and_unload model, and a GGUF LoRA file holding PEFT's own A and B (as PEFT saved them)
    under llama.cpp's names, with alpha."""
    from safetensors.torch import load_file

    target = gguf_dir / "lora"
    assert main(["-q", "merge", str(lora_ckpt.root), str(target), "--gguf", "f32", "--gguf-pre-tokenizer", "gpt-2"]) == 0
    fused, adapter = target / "qwen2-base-f32.gguf", target / "qwen2-base-lora-f32.gguf"
    assert sorted(p.name for p in target.glob("*.gguf")) == sorted([fused.name, adapter.name])
    recorded = json.loads((target / "hf_merge.json").read_text())["files"]  # hashed as each file was written
    card = (target / "README.md").read_text()  # the GGUF LoRA file, not a PEFT folder that is not there
    assert f"written as a llama.cpp GGUF LoRA file `{adapter.name}`" in card and "lora_adapter/" not in card
    assert recorded == {p.name: f"crc32:{zlib.crc32(p.read_bytes()):08x}" for p in (fused, adapter)}
    ids, _ = reference_logits(lora_ckpt)
    assert torch.equal(gguf_logits(fused, ids), model_logits(lora_ckpt.reference, ids, dtype=torch.float32))

    reader = gguf.GGUFReader(adapter)
    fields = reader.fields
    assert bytes(fields["general.type"].parts[-1]).decode() == "adapter"
    assert bytes(fields["adapter.type"].parts[-1]).decode() == "lora"
    assert float(fields["adapter.lora.alpha"].parts[-1][0]) == 8.0
    peft = load_file(Path(lora_ckpt.reference_adapter) / "adapter_model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == len(peft) == 2 * 7 * 2
    for gname, hname in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj"),
                         ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj")]:
        for suffix, key in ((".lora_a", "lora_A"), (".lora_b", "lora_B")):
            want = peft[f"base_model.model.{hname}.{key}.weight"].float()
            got = torch.from_numpy(tensors[gname + suffix].data.copy()).reshape(want.shape)
            assert torch.equal(got, want), gname + suffix


def test_lora_b_rows_follow_the_llama_permutation():
    """llama.cpp permutes a Llama q / k weight's rows; for a LoRA pair only B's rows move, since
    ``P(B @ A) = (P B) @ A`` (what llama.cpp's LoRA converter does)."""
    from hf_merge.gguf.writer import permute_rows

    torch.manual_seed(0)
    b, a = torch.randn(64, 4, dtype=torch.float64), torch.randn(4, 32, dtype=torch.float64)
    assert torch.equal(permute_rows(b @ a, 4), permute_rows(b, 4) @ a)


def tiny_hf_folder(arch: str, tokenizer_dir: Path, folder: Path) -> Path:
    """A tiny Qwen3 or Mistral saved by transformers' save_pretrained, with the tokenizer files
    of ``tokenizer_dir`` and a chat template."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2)
    # transformers' Qwen3 GGUF loader ignores key_length and assumes Qwen3's default head_dim, 128
    cfg = Qwen3Config(head_dim=128, **common) if arch == "qwen3" else MistralConfig(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, **dtype_kwargs(torch.float32))
    with torch.no_grad():  # the norms' ones would hide a norm written in the wrong place
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.rand_like(p))
    model.save_pretrained(folder)
    for f in Path(tokenizer_dir).glob("tokenizer*"):
        shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TEMPLATE)  # where transformers 5 saves it
    return folder


TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_hf_folder_source(arch, qwen2_fp32_ws2, tmp_path):
    """An existing Hugging Face folder (saved by transformers) as SOURCE: Qwen3 (q/k norms, no
    permutation) and Mistral (llama layout, permuted)."""
    src = tiny_hf_folder(arch, qwen2_fp32_ws2.hf_dir, tmp_path / f"{arch}-tiny")
    path = to_gguf(src, tmp_path / "out", "f32", "--gguf-pre-tokenizer", "gpt-2")
    assert path.name == f"{arch}-tiny-f32.gguf"
    assert bytes(gguf.GGUFReader(path).fields["tokenizer.chat_template"].parts[-1]).decode() == TEMPLATE
    ids, _ = reference_logits(qwen2_fp32_ws2)
    assert torch.equal(gguf_logits(path, ids), model_logits(src, ids, dtype=torch.float32))


def test_hf_folder_source_streams_rows(qwen2_fp32_ws2, tmp_path, monkeypatch):
    """A Hugging Face folder gives the GGUF writer row runs (``safe_open`` slices): with one-row
    chunks, no matrix is ever read whole, and the file is the same as with whole reads."""
    from hf_merge.gguf import quant
    from hf_merge.readers.hf_dir import HfDirCheckpoint

    src = tiny_hf_folder("qwen3", qwen2_fp32_ws2.hf_dir, tmp_path / "qwen3-tiny")
    whole = to_gguf(src, tmp_path / "whole", "q8_0", "--gguf-pre-tokenizer", "gpt-2")
    read_into = HfDirCheckpoint.read_into

    def vectors_only(self, name, out):
        assert out.dim() < 2, f"{name} was read whole"
        read_into(self, name, out)

    monkeypatch.setattr(HfDirCheckpoint, "read_into", vectors_only)
    monkeypatch.setattr(quant, "CHUNK_BYTES", 1)
    rows = to_gguf(src, tmp_path / "rows", "q8_0", "--gguf-pre-tokenizer", "gpt-2")
    assert rows.read_bytes() == whole.read_bytes()


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_moe_experts_stacked(arch, qwen2_fp32_ws2, tmp_path):
    """Qwen2-MoE / Qwen3-MoE: the per-expert tensors save_pretrained writes and transformers 5's
    in-memory stacked gate_up_proj / down_proj (what FSDP rank files hold) give the same GGUF,
    with llama.cpp's stacked ffn_{gate,up,down}_exps; its logits equal the HF model's."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    # transformers' GGUF loader reads no expert_feed_forward_length: keep its default widths
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=2)
    cfg = Qwen2MoeConfig(**common) if arch == "qwen2_moe" else Qwen3MoeConfig(norm_topk_prob=True, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, **dtype_kwargs(torch.float32))
    per_expert, stacked = tmp_path / "a" / f"{arch}-tiny", tmp_path / "b" / f"{arch}-tiny"
    model.save_pretrained(per_expert)
    stacked.mkdir(parents=True)
    shutil.copy(per_expert / "config.json", stacked)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or not cfg.tie_word_embeddings},
              stacked / "model.safetensors")
    for folder in (per_expert, stacked):
        for f in Path(qwen2_fp32_ws2.hf_dir).glob("tokenizer*"):
            shutil.copy(f, folder / f.name)
    a = to_gguf(per_expert, tmp_path / "out-a", "f32", "--gguf-pre-tokenizer", "gpt-2")
    b = to_gguf(stacked, tmp_path / "out-b", "f32", "--gguf-pre-tokenizer", "gpt-2")
    assert a.read_bytes() == b.read_bytes()
    tensors = {t.name: t for t in gguf.GGUFReader(a).tensors}
    assert tuple(tensors["blk.0.ffn_gate_exps.weight"].data.shape) == (4, cfg.moe_intermediate_size, 64)
    if TRANSFORMERS_4:
        # the same bytes as under transformers 5 (asserted above); 4.57's own GGUF loader, the oracle
        # below, cannot read MoE GGUF files back (IndexError for qwen2_moe, other logits for qwen3_moe)
        return
    ids, _ = reference_logits(qwen2_fp32_ws2)
    assert torch.equal(gguf_logits(a, ids), model_logits(per_expert, ids, dtype=torch.float32))


@pytest.mark.skipif(TRANSFORMERS_4, reason="the oracle is transformers 5's rope_parameters API")
def test_llama3_rope_freqs_match_transformers():
    """``rope_freqs`` = transformers' default inv_freq / its llama3-scaled inv_freq, per frequency."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hf_merge.gguf.hparams import rope_freqs

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, max_position_embeddings=131072, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    got = torch.from_numpy(rope_freqs(cfg.to_dict()))
    assert got.shape == (64,)
    torch.testing.assert_close(got, base / scaled, rtol=1e-5, atol=0)
    assert rope_freqs({**cfg.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}) is None


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="k-quants need llama-cpp-python")
@pytest.mark.parametrize("kind", ["q4_k_m", "q5_k_m", "q6_k"])
def test_k_quants_run_in_llama_cpp(kind, llama_sp_folder, tmp_path_factory):
    """K-quants (only where llama-cpp-python is installed; ``make test`` has none): a Llama whose
    rows are multiples of 256 (so llama.cpp really uses the K types) -> BF16 -> llama.cpp's C
    quantizer; the file has the k-quant file type and K tensors, and llama.cpp's logits for the
    same ids are close to the HF model's (and its F32 file's are equal to them up to float error)."""
    import llama_cpp
    import numpy as np
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.getbasetemp() / "kquant-src"
    src = root / "llama-k"
    if not src.is_dir():
        src.mkdir(parents=True)
        cfg = LlamaConfig(vocab_size=416, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, **dtype_kwargs(torch.float32)).save_pretrained(src)
        for f in llama_sp_folder.glob("tokenizer*"):
            shutil.copy(f, src / f.name)
    ids = list(range(3, 40))
    want = model_logits(src, torch.tensor([ids]), dtype=torch.float32)[0].numpy()

    def run(path: Path) -> np.ndarray:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, n_threads=2, verbose=False)
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)

    def cosine(a, b):
        return float(((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).min())

    path = to_gguf(src, tmp_path_factory.mktemp(kind), kind)
    reader = gguf.GGUFReader(path)
    ftype = gguf.LlamaFileType[f"MOSTLY_{kind.upper()}"]
    assert int(reader.fields["general.file_type"].parts[-1][0]) == ftype
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_up.weight"].endswith("_K") and types["blk.0.attn_norm.weight"] == "F32"
    assert not list(path.parent.glob(".*bf16*"))  # the intermediate BF16 file is gone
    f32 = to_gguf(src, tmp_path_factory.mktemp(f"{kind}-f32"), "f32")
    assert cosine(run(f32), want) > 0.99999
    assert cosine(run(path), want) > {"q4_k_m": 0.97, "q5_k_m": 0.99, "q6_k": 0.995}[kind]


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------


def test_tokenizer_ids_equal_hf(qwen2_fp32_ws2, qwen2_q8):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen2_fp32_ws2.hf_dir)
    from_gguf = AutoTokenizer.from_pretrained(qwen2_q8.parent, gguf_file=qwen2_q8.name)
    for text in TEXTS:
        assert from_gguf.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
    fields = gguf.GGUFReader(qwen2_q8).fields
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt-2"
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "gpt2"
    assert int(fields["tokenizer.ggml.eos_token_id"].parts[-1][0]) == hf.eos_token_id


SP_TEXTS = TEXTS + ["héllo wörld 日本語 🦙", "jumps over the lazy dog<|im_end|>tokenizer"]


def test_sentencepiece_tokenizer(llama_sp_folder, tmp_path):
    """A SentencePiece (Llama-2 style) tokenizer is written as llama.cpp's ``llama`` vocabulary:
    pieces, scores and types from tokenizer.model, the added special token as CONTROL, padding
    UNUSED; the tokenizer transformers rebuilds from the GGUF gives the HF tokenizer's ids."""
    import sentencepiece
    from transformers import AutoTokenizer

    path = to_gguf(llama_sp_folder, tmp_path / "out", "f32")
    hf = AutoTokenizer.from_pretrained(llama_sp_folder)
    from_gguf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in SP_TEXTS:
        assert from_gguf.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text

    fields = gguf.GGUFReader(path).fields
    text = lambda key: bytes(fields[key].parts[-1]).decode()  # noqa: E731
    assert (text("tokenizer.ggml.model"), text("tokenizer.ggml.pre")) == ("llama", "default")
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    scores = [float(fields["tokenizer.ggml.scores"].parts[i][0]) for i in fields["tokenizer.ggml.scores"].data]
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    sp = sentencepiece.SentencePieceProcessor(model_file=str(llama_sp_folder / "tokenizer.model"))
    assert len(tokens) == len(scores) == len(types) == 416
    assert tokens[:400] == [sp.IdToPiece(i) for i in range(400)]
    assert scores[3:400] == [sp.GetScore(i) for i in range(3, 400)]
    T = gguf.TokenType
    # as llama.cpp's converter does, the tokens the HF tokenizer lists as special added tokens
    # (<unk> <s> </s>) are CONTROL with score -1000
    assert types[:3] == [T.CONTROL] * 3 and scores[:3] == [-1000.0] * 3 and types[3:259] == [T.BYTE] * 256
    assert set(types[259:400]) == {T.NORMAL}
    assert (tokens[400], types[400], scores[400]) == ("<|im_end|>", T.CONTROL, -1000.0)
    assert tokens[401:] == [f"[PAD{i}]" for i in range(401, 416)] and set(types[401:]) == {T.UNUSED}
    assert int(fields["tokenizer.ggml.bos_token_id"].parts[-1][0]) == 1
    assert int(fields["tokenizer.ggml.eos_token_id"].parts[-1][0]) == 2


def test_pre_tokenizer_hash_rule(tmp_path, qwen2_fp32_ws2):
    """llama.cpp's own GPT-2 vocabulary is recognised as ``gpt-2``; a tokenizer trained here has a
    hash llama.cpp does not know: an error that says what to pass."""
    from transformers import AutoTokenizer

    from hf_merge.gguf.vocab import pre_tokenizer_name

    src = DATA / "gguf_gpt2_tokenizer"
    shutil.copy(src / "tokenizer_config.json", tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(gzip.decompress((src / "tokenizer.json.gz").read_bytes()))
    assert pre_tokenizer_name(AutoTokenizer.from_pretrained(tmp_path)) == "gpt-2"
    with pytest.raises(MappingError, match="unknown to llama.cpp.*--gguf-pre-tokenizer"):
        pre_tokenizer_name(AutoTokenizer.from_pretrained(qwen2_fp32_ws2.hf_dir))
    with pytest.raises(MappingError, match="unknown pre-tokenizer 'nope'"):
        pre_tokenizer_name(None, "nope")


# ------------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------------


def test_refusals(qwen2_fp32_ws2, tmp_path, capsys):
    from hf_merge.gguf.arch import arch_for
    from hf_merge.gguf.quant import file_type
    from hf_merge.gguf.tokenizer import load_vocab

    if importlib.util.find_spec("llama_cpp") is None:  # without llama-cpp-python, k-quants say how to get them
        with pytest.raises(QuantizationError, match="k-quant.*pip install llama-cpp-python.*llama-quantize"):
            file_type("q4_k_m")
    with pytest.raises(QuantizationError, match="unknown GGUF type 'q3'"):
        file_type("q3")
    with pytest.raises(MappingError, match="model_type 'gpt2'.*supported: llama, mistral, qwen2, qwen2_moe, qwen3, qwen3_moe"):
        arch_for({"model_type": "gpt2"})
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(MappingError, match="not a valid SentencePiece model"):
        load_vocab(tmp_path, 128)
    # the CLI: one line, nothing written, and the hash rule without an override
    assert main(["merge", str(qwen2_fp32_ws2.root), str(tmp_path / "x"), "--gguf", "q8_0"]) != 0
    err = capsys.readouterr().err
    assert "error: " in err and "--gguf-pre-tokenizer" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_verify_of_a_gguf_folder_says_what_it_can_check(qwen2_fp32_ws2, qwen2_q8, capsys):
    """Before: `hf-merge verify GGUF_DIR --against SRC` said "no *.safetensors files in GGUF_DIR",
    as if the folder were damaged. Now one line says verify compares safetensors folders and what
    to check a GGUF file with."""
    assert main(["verify", str(qwen2_q8.parent), "--against", str(qwen2_fp32_ws2.root)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"holds a GGUF file ({qwen2_q8.name})" in lines[0] and "no --against" in lines[0] and "without --gguf" in lines[0]
    # what that line suggests: the checksum recorded when the file was written, checked without a source
    assert main(["verify", str(qwen2_q8.parent)]) == 0
    out = capsys.readouterr().out
    assert "file checksums" in out and "1 file\n" in out, out


# ------------------------------------------------------------------------------------------------
# model card and push
# ------------------------------------------------------------------------------------------------

from test_hub import hub, inproc  # noqa: E402,F401 - the loopback Hub stand-in fixtures


@pytest.mark.skipif(TRANSFORMERS_4, reason="the loopback Hub stand-in needs huggingface_hub >= 1 (httpx); 4.57 pins < 1")
def test_push_gguf_folder(inproc, qwen2_q8, tmp_path):
    """A GGUF folder (no config.json) pushes; its card is a GGUF card: library_name gguf, tags gguf
    and the type, a llama.cpp / llama-cpp-python snippet naming the file."""
    from huggingface_hub import ModelCard

    from hf_merge.publish.hub import push

    folder = Path(shutil.copytree(qwen2_q8.parent, tmp_path / "up"))
    push(folder, "tester/tiny-gguf", private=False)
    files = inproc.repos["tester/tiny-gguf"].files
    assert set(files) == {qwen2_q8.name, "README.md", "hf_merge.json"}
    assert files[qwen2_q8.name] == qwen2_q8.read_bytes()
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "gguf"
    assert {"gguf", "q8-0", "hf-merge"} <= set(card.data.tags)
    assert f'Llama.from_pretrained(repo_id="tester/tiny-gguf", filename="{qwen2_q8.name}")' in card.text


def test_prefetched_keeps_order_and_raises_where_the_source_failed():
    """The writer's encode-ahead thread: items in order, a failure of the producer raised to the
    consumer after the items before it, and a consumer that stops early stops the thread."""
    from hf_merge.gguf.pipeline import prefetched

    def source(fail_at: int | None):
        for i in range(10):
            if i == fail_at:
                raise QuantizationError(f"broken at {i}")
            yield i

    assert list(prefetched(source(None), depth=2)) == list(range(10))
    got = []
    with pytest.raises(QuantizationError, match="broken at 4"):
        for item in prefetched(source(4)):
            got.append(item)
    assert got == [0, 1, 2, 3]
    early = prefetched(source(None))
    assert next(early) == 0
    early.close()  # joins the thread


def _file_types(path: Path) -> dict[str, int]:
    from collections import Counter

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors))


def _dtype_row(card_text: str) -> str:
    return next(ln for ln in card_text.splitlines() if ln.startswith("| dtype |"))


def test_card_and_json_say_what_the_gguf_file_holds(qwen2_fp32_ws2, tmp_path, capsys):
    """The card said ``q8_0` weights (gguf), other tensors `q8_0``, but norms and biases are F32 in the
    file; ``--json`` printed ``"quantization": null`` where hf_merge.json records {"method": "gguf", ...}."""
    target = tmp_path / "q8"
    assert main(["merge", str(qwen2_fp32_ws2.root), str(target), "--gguf", "q8_0", "--gguf-pre-tokenizer", "gpt-2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    record = json.loads((target / "hf_merge.json").read_text())
    assert record["quantization"] == {"method": "gguf", "mode": "q8_0"}
    assert out["quantization"] == record["quantization"]["mode"]
    (path,) = target.glob("*.gguf")
    types = _file_types(path)
    assert set(types) == {"Q8_0", "F32"}
    row = _dtype_row((target / "README.md").read_text())
    assert row.startswith("| dtype | GGUF `q8_0`: ") and "other tensors" not in row, row
    for type_name, n in types.items():
        assert f"{n} tensors `{type_name}`" in row, row


def test_card_of_a_gguf_lora_file_describes_an_adapter(lora_ckpt, tmp_path, capsys):
    """``--lora adapter --gguf``: the card said "kept as a PEFT adapter", base_model_relation finetune
    and "(fine-tuned)" for a llama.cpp LoRA GGUF (general.type adapter)."""
    from huggingface_hub import ModelCard

    target = tmp_path / "lora"
    assert main(["merge", str(lora_ckpt.root), str(target), "--gguf", "q8_0", "--lora", "adapter"]) == 0
    summary = capsys.readouterr().err.splitlines()[-1]  # the type, not "q8_0 (bitsandbytes)"
    assert summary.startswith("wrote the LoRA adapter ") and summary.endswith(", GGUF q8_0)"), summary
    (path,) = target.glob("*.gguf")
    assert bytes(gguf.GGUFReader(path).fields["general.type"].parts[-1]).decode() == "adapter"
    card = ModelCard((target / "README.md").read_text())
    assert card.data.base_model_relation == "adapter" and card.data.library_name == "gguf"
    assert "(LoRA adapter)" in card.text and "fine-tuned" not in card.text
    assert "PEFT" not in card.text and f"written as a llama.cpp GGUF LoRA file `{path.name}`" in card.text
    assert f"--lora {path.name}" in card.text
    row = _dtype_row(card.text)
    for type_name, n in _file_types(path).items():
        assert f"{n} tensors `{type_name}`" in row, row
