"""bitsandbytes output (``--quantize``): byte-for-byte what transformers writes, loadable as is.

Sources are REAL FSDP2 checkpoints (``tests/conftest.py``: tiny Qwen2, hidden 64, intermediate
128, vocab 128, fp32 training, bf16 config), a real LoRA one, a tied-embedding Llama (world size
4) and a Hugging Face folder. Each quantized output is compared with what transformers itself
produces by quantizing the plain merge in memory (``from_pretrained(plain,
quantization_config=BitsAndBytesConfig(...))`` then ``save_pretrained``): tensor names, dtypes,
shapes and bytes, config.json's ``quantization_config``, and logits against the fp32 reference.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers import error_line, folder_tensors, reference_logits, run_cli
from safetensors import safe_open

from hf_merge.checkpoint import open_checkpoint
from hf_merge.errors import QuantizationError
from hf_merge.hf_files import copy_side_files, find_config_dir, load_config, write_config
from hf_merge.merging import merge
from hf_merge.transforms.views import model_view
from hf_merge.write.plan import plan_shards
from hf_merge.write.shards import write_shards

from hf_merge.transforms import quantize as qmod
from hf_merge.transforms.quantize import QuantizeOptions, Quantized

try:
    import bitsandbytes as bnb
except ImportError:  # the optional extra; only the tests of its absence run then
    bnb = None
needs_bnb = pytest.mark.skipif(bnb is None, reason="needs pip install bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

MODES = {
    "nf4": QuantizeOptions("nf4"),
    "fp4": QuantizeOptions("fp4"),
    "int8": QuantizeOptions("int8"),
    "nf4-dq": QuantizeOptions("nf4", double_quant=True),
}
EPS = 1e-3  # hf_merge's logit error may exceed transformers' own by this factor at most


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def bnb_config(opts: QuantizeOptions, compute_dtype=torch.bfloat16, skip=None):
    from transformers import BitsAndBytesConfig

    if not opts.is_4bit:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=opts.mode,
        bnb_4bit_use_double_quant=opts.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=skip,
    )


def load(folder: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def is_blob(name: str) -> bool:
    return ".quant_state.bitsandbytes__" in name


def assert_same_as_transformers(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], double_quant: bool):
    assert sorted(ours) == sorted(theirs), (sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours)))
    for name, want in theirs.items():
        got = ours[name]
        assert got.dtype == want.dtype, f"{name}: {got.dtype} != {want.dtype}"
        if is_blob(name) and double_quant:
            # The one planned deviation: the JSON is padded with trailing spaces to a fixed size.
            assert raw_bytes(got).rstrip(b" ") == raw_bytes(want), name
            assert json.loads(raw_bytes(got)) == json.loads(raw_bytes(want)), name
            continue
        assert got.shape == want.shape, f"{name}: {tuple(got.shape)} != {tuple(want.shape)}"
        assert raw_bytes(got) == raw_bytes(want), f"{name}: bytes differ"


def expected_parts(opts: QuantizeOptions) -> list[str]:
    """transformers' own list of what a quantized weight serializes to (``serialized_names``)."""
    if opts.is_4bit:
        from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

        names = Bnb4BitHfQuantizer.serialized_names["weight"]
        names = [n for n in names if "quant_state" not in n or n.endswith(opts.mode)]
        return [n for n in names if "nested" not in n or opts.double_quant]
    from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer

    return list(Bnb8BitHfQuantizer.serialized_names["weight"])


# ------------------------------------------------------------------------------------------------
# fixtures: plain merge, transformers' in-memory quantization of it, hf_merge's quantized merges
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(qwen2_fp32_ws2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plain") / "model"
    merge(qwen2_fp32_ws2.actor, out)
    return out


@pytest.fixture(scope="module")
def quantized(qwen2_fp32_ws2, tmp_path_factory):
    """``quantized(mode)`` -> folder of ``merge(..., quantize=MODES[mode])`` (built once)."""
    built: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in built:
            out = tmp_path_factory.mktemp(f"q-{mode}") / "model"
            merge(qwen2_fp32_ws2.actor, out, quantize=MODES[mode])
            built[mode] = out
        return built[mode]

    return get


@pytest.fixture(scope="module")
def transformers_quantized(plain, tmp_path_factory):
    """``transformers_quantized(mode)`` -> (in-memory quantized model, its save_pretrained folder)."""
    built: dict[str, tuple] = {}

    def get(mode: str):
        if mode not in built:
            model = load(plain, quantization_config=bnb_config(MODES[mode]))
            out = tmp_path_factory.mktemp(f"tf-{mode}") / "model"
            model.save_pretrained(out)
            built[mode] = (model, out)
        return built[mode]

    return get


# ------------------------------------------------------------------------------------------------
# the acceptance tests
# ------------------------------------------------------------------------------------------------


@needs_bnb
@pytest.mark.parametrize("mode", list(MODES))
def test_loads_with_no_extra_argument_and_matches_transformers_accuracy(mode, qwen2_fp32_ws2, quantized, transformers_quantized):
    ids, ref = reference_logits(qwen2_fp32_ws2)
    ours = load(quantized(mode))  # no quantization_config, no device_map: config.json says it all
    assert getattr(ours, "is_loaded_in_8bit" if mode == "int8" else "is_loaded_in_4bit", False)
    layer = ours.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == ("Linear8bitLt" if mode == "int8" else "Linear4bit")
    assert type(ours.lm_head) is torch.nn.Linear and ours.lm_head.weight.dtype == torch.bfloat16

    tf_model, _ = transformers_quantized(mode)
    ours_err, tf_err = max_err(logits(ours, ids), ref), max_err(logits(tf_model, ids), ref)
    assert torch.isfinite(logits(ours, ids)).all()
    assert ours_err <= tf_err * (1 + EPS), f"{mode}: hf_merge error {ours_err} > transformers' {tf_err}"
    assert 0 < ours_err < (0.1 if mode == "int8" else 1.0)  # it is quantized, and still the same model


@needs_bnb
@pytest.mark.parametrize("mode", list(MODES))
def test_files_and_config_are_what_transformers_saves(mode, quantized, transformers_quantized):
    _, tf_dir = transformers_quantized(mode)
    out = quantized(mode)
    assert_same_as_transformers(folder_tensors(out), folder_tensors(tf_dir), MODES[mode].double_quant)
    ours_cfg = json.loads((out / "config.json").read_text())
    tf_cfg = json.loads((tf_dir / "config.json").read_text())
    assert ours_cfg["quantization_config"] == tf_cfg["quantization_config"]
    assert ours_cfg["dtype"] == tf_cfg["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"


@needs_bnb
@pytest.mark.parametrize("mode", list(MODES))
def test_quant_state_tensors_transformers_expects(mode, quantized):
    opts = MODES[mode]
    tensors = folder_tensors(quantized(mode))
    modules = sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith("_proj.weight")})
    assert len(modules) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    want = expected_parts(opts)
    for m in modules:
        parts = sorted(n[len(m) + 1 :] for n in tensors if n.startswith(m + ".") and not n.endswith(".bias"))
        assert parts == sorted(want), (m, parts)
    # transformers' own deserializer rebuilds each state (the from_pretrained path)
    if opts.is_4bit:
        m = modules[0]
        stats = {k: v for k, v in tensors.items() if k.startswith(f"{m}.weight.")}
        p = bnb.nn.Params4bit.from_prequantized(tensors[f"{m}.weight"], stats, device="cpu")
        assert m == "model.layers.0.mlp.down_proj" and p.quant_state.shape == torch.Size([64, 128])
        assert p.quant_state.nested == opts.double_quant and p.quant_state.quant_type == opts.mode
    else:
        assert all(tensors[f"{m}.weight_format"].item() == 0 for m in modules)


@needs_bnb
@pytest.mark.parametrize("mode", list(MODES))
def test_bit_identical_to_bitsandbytes_functional(mode, plain, quantized):
    opts = MODES[mode]
    ours = folder_tensors(quantized(mode))
    base = folder_tensors(plain)
    F = bnb.functional
    for name, w in base.items():
        m = name.removesuffix(".weight")
        if not name.endswith("_proj.weight"):
            assert torch.equal(ours[name], w)  # norms, biases, embeddings, lm_head: untouched
            continue
        if opts.is_4bit:
            q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=opts.double_quant, quant_type=opts.mode)
            want = {f"{m}.weight": q, **{f"{m}.weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
        else:
            cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
            want = {f"{m}.weight": cb, f"{m}.SCB": scb}
        for k, v in want.items():
            got = ours[k]
            if is_blob(k):
                assert raw_bytes(got).rstrip(b" ") == raw_bytes(v), k
            else:
                assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k


@needs_bnb
def test_provenance_records_quantization(quantized):
    prov = json.loads((quantized("nf4-dq") / "hf_merge.json").read_text())["quantization"]
    assert {k: prov[k] for k in ("method", "mode", "double_quant", "compute_dtype", "skipped")} == {
        "method": "bitsandbytes", "mode": "nf4", "double_quant": True, "compute_dtype": "bfloat16", "skipped": ["lm_head"],
    }
    prov8 = json.loads((quantized("int8") / "hf_merge.json").read_text())["quantization"]
    assert prov8["mode"] == "int8" and prov8["double_quant"] is False and prov8["skipped"] == ["lm_head"]


# ------------------------------------------------------------------------------------------------
# streaming: sizes from specs, a module's parts together, each module quantized once
# ------------------------------------------------------------------------------------------------


def _view(actor, opts):
    ckpt = open_checkpoint(actor)
    cfg = load_config(find_config_dir(ckpt.info.hf_dir, ckpt.info.path))
    view, out_dtype, _ = model_view(ckpt, cfg)
    return Quantized(view, cfg, opts), cfg, out_dtype, ckpt.info.hf_dir


@needs_bnb
def test_sharded_streaming_write_quantizes_each_module_once(qwen2_fp32_ws2, quantized, tmp_path):
    q, cfg, out_dtype, hf_dir = _view(qwen2_fp32_ws2.actor, MODES["nf4-dq"])
    plan = plan_shards(q.specs(), max_shard_size=12_000, group=q.group)
    assert len(plan.files) > 3
    calls = []
    real = q._module_parts

    def spy(module):
        calls.append(module)
        parts = real(module)
        assert len(q._cache) <= qmod.LRU_MODULES
        return parts

    q._module_parts = spy
    write_shards(q, plan, tmp_path, workers=1)
    assert q.quantize_calls == len(q.quantized) == 14  # never twice: parts are written back to back
    assert not q._cache  # each module released once its last part was written

    # every module's parts sit in ONE file, as one contiguous run of the data section
    unaligned = 0
    for fp in plan.files:
        runs: dict[str, list[int]] = {}
        for i, spec in enumerate(fp.specs):
            g = q.group(spec)
            if g is not None:
                runs.setdefault(g, []).append(i)
            unaligned += (fp.data_start + fp.offsets[spec.name]) % spec.dtype.itemsize != 0
        for g, idx in runs.items():
            assert idx == list(range(idx[0], idx[0] + len(idx))), g
            assert all(plan.index["weight_map"][n] == fp.name for n in q.specs() if q.group(q.specs()[n]) == g)
    assert unaligned > 0  # the writer's unaligned path is exercised ...

    # ... and the bytes equal the single-file merge; safetensors and transformers read them
    assert_same_as_transformers(folder_tensors(tmp_path), folder_tensors(quantized("nf4-dq")), double_quant=False)
    write_shards(q, plan, tmp_path / "parallel", workers=2)  # forked writers, a share of the files each
    for fp in plan.files:
        assert (tmp_path / "parallel" / fp.name).read_bytes() == (tmp_path / fp.name).read_bytes()
    write_config(q.output_config(cfg), tmp_path, dtype=out_dtype)
    copy_side_files(hf_dir, tmp_path)
    ids, ref = reference_logits(qwen2_fp32_ws2)
    single = load(quantized("nf4-dq"))
    assert torch.equal(logits(load(tmp_path), ids), logits(single, ids))


@needs_bnb
def test_specs_are_computed_without_quantizing():
    """Every part's shape/dtype (and the JSON blob's size) from the input spec alone."""
    from hf_merge.spec import TensorSpec

    torch.manual_seed(0)
    for shape in [(32, 64), (96, 192), (7, 9), (1, 4097)]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            w = torch.randn(shape, dtype=dtype)
            spec = TensorSpec("m.weight", shape, dtype)
            for opts in MODES.values():
                parts = (qmod.quantize_4bit(bnb, w, opts.mode, opts.double_quant) if opts.is_4bit else qmod.quantize_int8(bnb, w))
                specs = {s.name[2:]: s for s in qmod.part_specs("m", spec, opts, shape)}
                assert sorted(specs) == sorted(parts), opts
                for k, v in parts.items():
                    assert v.dtype == specs[k].dtype, (k, opts)
                    if is_blob(k) and opts.double_quant:
                        assert v.numel() <= specs[k].numel, k  # reserved, then padded
                    else:
                        assert tuple(v.shape) == specs[k].shape, (k, opts)


@needs_bnb
def test_chunked_quantization_is_bit_identical(monkeypatch):
    monkeypatch.setattr(qmod, "CHUNK_ELEMENTS", 4096 * 2)
    torch.manual_seed(1)
    w = torch.randn(200, 130, dtype=torch.bfloat16)  # 26000 values: 4 chunks, odd tail block
    F = bnb.functional
    for qt in ("nf4", "fp4"):
        for dq in (False, True):
            ours = qmod.quantize_4bit(bnb, w, qt, dq)
            q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=dq, quant_type=qt)
            want = {"weight": q, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
            assert sorted(ours) == sorted(want)
            for k in want:
                assert raw_bytes(ours[k]) == raw_bytes(want[k]) and ours[k].shape == want[k].shape, (qt, dq, k)
    monkeypatch.setattr(qmod, "CHUNK_ELEMENTS", 130 * 7)
    ours = qmod.quantize_int8(bnb, w)
    cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
    assert torch.equal(ours["weight"], cb) and torch.equal(ours["SCB"], scb)


@needs_bnb
def test_default_plan_unchanged_and_aligned():
    from hf_merge.spec import TensorSpec

    specs = [TensorSpec(n, s, d) for n, s, d in [("a", (3,), torch.uint8), ("b", (5,), torch.float32), ("c", (2,), torch.bfloat16)]]
    (fp,) = plan_shards(specs).files
    assert [s.name for s in fp.specs] == ["b", "c", "a"]  # (itemsize desc, name), as before
    assert all((fp.data_start + fp.offsets[s.name]) % s.dtype.itemsize == 0 for s in fp.specs)


# ------------------------------------------------------------------------------------------------
# layers left unquantized: kernel limits, user skips, tied embeddings, LoRA fusion
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def narrow_kv_hf(tmp_path_factory) -> Path:
    """An HF folder (the `hf` source format) whose k_proj / v_proj have 16 outputs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=False, dtype="bfloat16",
    )
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("narrow") / "src"
    model.save_pretrained(out)
    return out


@needs_bnb
def test_layers_the_cpu_kernel_cannot_run_stay_plain(narrow_kv_hf, tmp_path):
    out = tmp_path / "nf4"
    result = merge(narrow_kv_hf, out, backend="hf", quantize="nf4")
    narrow = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("k_proj", "v_proj")]
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["llm_int8_skip_modules"] == sorted(["lm_head", *narrow])
    assert sum("out_features divisible by 32" in n for n in result.notes) == 4
    prov = result.provenance["quantization"]
    assert prov["skipped"] == sorted(["lm_head", *narrow])
    tensors = folder_tensors(out)
    for m in narrow:
        assert tensors[f"{m}.weight"].dtype == torch.bfloat16 and f"{m}.weight.absmax" not in tensors

    ids = torch.arange(16).view(2, 8)
    ours = load(out)
    assert type(ours.model.layers[0].self_attn.k_proj) is torch.nn.Linear
    assert type(ours.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    same = load(narrow_kv_hf, quantization_config=bnb_config(QuantizeOptions("nf4"), skip=cfg["llm_int8_skip_modules"]))
    assert torch.equal(logits(ours, ids), logits(same, ids))
    if bnb.functional.has_avx512bf16():  # what the skip avoids: transformers' default breaks at run time
        broken = load(narrow_kv_hf, quantization_config=bnb_config(QuantizeOptions("nf4")))
        with pytest.raises((AssertionError, RuntimeError)):
            logits(broken, ids)

    # int8 runs any shape: only the default skips, written as transformers does (null)
    out8 = tmp_path / "int8"
    merge(narrow_kv_hf, out8, backend="hf", quantize="int8")
    assert json.loads((out8 / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"] is None
    assert torch.isfinite(logits(load(out8), ids)).all()


@needs_bnb
def test_user_skip_modules_keep_the_defaults(qwen2_fp32_ws2, plain, tmp_path):
    out = tmp_path / "out"
    merge(qwen2_fp32_ws2.actor, out, quantize=QuantizeOptions("fp4", skip_modules=("mlp.down_proj",)))
    skip = json.loads((out / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]
    assert skip == ["lm_head", "mlp.down_proj"]
    tensors = folder_tensors(out)
    assert tensors["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.mlp.up_proj.weight"].dtype == torch.uint8
    ids, _ = reference_logits(qwen2_fp32_ws2)
    same = load(plain, quantization_config=bnb_config(QuantizeOptions("fp4"), skip=skip))
    assert torch.equal(logits(load(out), ids), logits(same, ids))


@needs_bnb
def test_a_skip_that_matches_no_layer_is_warned(qwen2_fp32_ws2, tmp_path):
    """`--quant-skip-modules down_poj` (a typo): before, every layer was quantized without a word.
    Now a warning names the list and what matches; a list that matches stays quiet."""
    proc = run_cli("merge", qwen2_fp32_ws2.actor, tmp_path / "typo", "--quantize", "nf4", "--quant-skip-modules", "down_poj")
    assert proc.returncode == 0, proc.stderr
    assert "warning: --quant-skip-modules down_poj matches no layer that would be quantized" in proc.stderr, proc.stderr
    proc = run_cli("merge", qwen2_fp32_ws2.actor, tmp_path / "ok", "--quantize", "nf4", "--quant-skip-modules", "down_proj")
    assert proc.returncode == 0 and "--quant-skip-modules" not in proc.stderr, proc.stderr


@needs_bnb
def test_tied_embeddings_world_size_4(llama_tied_bf16_ws4, tmp_path):
    plain_dir, out = tmp_path / "plain", tmp_path / "nf4"
    merge(llama_tied_bf16_ws4.actor, plain_dir)
    merge(llama_tied_bf16_ws4.actor, out, quantize="nf4")
    tensors = folder_tensors(out)
    assert "lm_head.weight" not in tensors and tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    ids, ref = reference_logits(llama_tied_bf16_ws4)
    ours = load(out)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    tf = load(plain_dir, quantization_config=bnb_config(QuantizeOptions("nf4")))
    assert max_err(logits(ours, ids), ref) <= max_err(logits(tf, ids), ref) * (1 + EPS)


@needs_bnb
def test_quantize_after_lora_fusion(lora_ckpt, tmp_path):
    plain_dir, out = tmp_path / "plain", tmp_path / "nf4"
    merge(lora_ckpt.actor, plain_dir, lora="fuse")
    result = merge(lora_ckpt.actor, out, lora="fuse", quantize=QuantizeOptions("nf4", double_quant=True))
    assert result.provenance["lora"] is not None and result.provenance["quantization"]["double_quant"] is True
    ids, ref = reference_logits(lora_ckpt)  # the PEFT model's merge_and_unload(), fp32
    ours = load(out)
    tf = load(plain_dir, quantization_config=bnb_config(QuantizeOptions("nf4", double_quant=True)))
    ours_err, tf_err = max_err(logits(ours, ids), ref), max_err(logits(tf, ids), ref)
    assert ours_err <= tf_err * (1 + EPS)
    # the FUSED weight was quantized: same bytes as bitsandbytes on the plain fused merge
    w = folder_tensors(plain_dir)["model.layers.0.self_attn.q_proj.weight"]
    q, _ = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(folder_tensors(out)["model.layers.0.self_attn.q_proj.weight"], q)
    from hf_merge.verification import verify

    report = verify(out, lora_ckpt.actor)  # LoRA fused again, then quantized again: byte-identical
    assert report.ok, report.table()


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------


def test_missing_bitsandbytes_is_one_line(qwen2_fp32_ws2, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` fails, as when not installed
    monkeypatch.delitem(sys.modules, "bitsandbytes.functional", raising=False)
    target = tmp_path / "out"
    proc = run_cli("merge", qwen2_fp32_ws2.actor, target, "--quantize", "nf4")
    line = error_line(proc)
    assert "bitsandbytes" in line and "pip install bitsandbytes" in line, line
    assert proc.returncode == 2 and not target.exists()
    # the same interpreter merges fine without --quantize
    assert run_cli("merge", qwen2_fp32_ws2.actor, target).returncode == 0


@pytest.mark.parametrize(
    "flags, text",
    [
        (["--double-quant"], "--double-quant needs --quantize"),
        (["--quantize", "int8", "--double-quant"], "4-bit output only"),
        (["--quantize", "int8", "--quant-compute-dtype", "float16"], "4-bit output only"),
    ],
)
def test_flag_errors_are_one_line(flags, text, qwen2_fp32_ws2, tmp_path):
    proc = run_cli("merge", qwen2_fp32_ws2.actor, tmp_path / "out", *flags)
    assert text in error_line(proc)


def test_options_validation():
    with pytest.raises(QuantizationError, match="unknown quantization"):
        QuantizeOptions("int4")
    assert QuantizeOptions.coerce("fp4") == QuantizeOptions("fp4")
    assert QuantizeOptions("nf4", compute_dtype="bf16").compute_dtype == "bfloat16"
    assert qmod.quant_state_blob_size("nf4", torch.bfloat16, (64, 64), False) == 78  # as transformers wrote it


@needs_bnb
def test_cli_quantize_flags(qwen2_fp32_ws2, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(
        "merge", qwen2_fp32_ws2.actor, out, "--quantize", "nf4", "--double-quant",
        "--quant-compute-dtype", "float16", "--quant-skip-modules", "mlp.gate_proj, mlp.up_proj",
    )
    assert proc.returncode == 0, proc.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["bnb_4bit_compute_dtype"] == "float16" and qc["bnb_4bit_use_double_quant"] is True
    assert qc["llm_int8_skip_modules"] == ["lm_head", "mlp.gate_proj", "mlp.up_proj"]
    assert load(out).model.layers[0].mlp.gate_proj.__class__ is torch.nn.Linear


@needs_bnb
def test_odd_shapes_int8_works_and_4bit_refuses_in_one_line(uneven_ckpt, tmp_path):
    """hidden 6, one KV head of size 2 (world size 4, uneven / empty shards)."""
    proc = run_cli("merge", uneven_ckpt.actor, tmp_path / "nf4", "--quantize", "nf4")
    line = error_line(proc)
    assert "no layer of this model can be quantized" in line and not (tmp_path / "nf4").exists()
    assert line.endswith("merge with --quantize int8 (no such shape limit) or without --quantize"), line

    plain_dir, out = tmp_path / "plain", tmp_path / "int8"
    merge(uneven_ckpt.actor, plain_dir)
    merge(uneven_ckpt.actor, out, quantize="int8")
    ids, ref = reference_logits(uneven_ckpt)
    ours = load(out)
    assert type(ours.model.layers[0].self_attn.k_proj).__name__ == "Linear8bitLt"
    tf = load(plain_dir, quantization_config=bnb_config(QuantizeOptions("int8")))
    assert max_err(logits(ours, ids), ref) <= max_err(logits(tf, ids), ref) * (1 + EPS)


@needs_bnb
@pytest.mark.parametrize("mode", ["nf4-dq", "int8"])
def test_verify_requantizes_and_catches_a_flipped_packed_byte(mode, qwen2_fp32_ws2, tmp_path):
    from safetensors.torch import load_file, save_file

    target = tmp_path / "q"
    result = merge(qwen2_fp32_ws2.actor, target, quantize=MODES[mode], verify=True)
    assert result.provenance["verification"]["passed"] is True
    proc = run_cli("verify", target, "--against", qwen2_fp32_ws2.actor)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "re-quantized" in proc.stdout and "bit-exact" in proc.stdout

    # One packed byte of one quantized weight changed (checksums dropped so only values can tell).
    name = "model.layers.1.mlp.down_proj.weight"
    tensors = load_file(target / "model.safetensors")
    assert tensors[name].dtype == (torch.uint8 if MODES[mode].is_4bit else torch.int8)
    tensors[name].view(torch.uint8).view(-1)[5] ^= 0x10
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    record = json.loads((target / "hf_merge.json").read_text())
    (target / "hf_merge.json").write_text(json.dumps({**record, "files": {}}))
    proc = run_cli("verify", target, "--against", qwen2_fp32_ws2.actor)
    assert proc.returncode == 1
    assert f"{name}: not bit-identical" in proc.stdout
