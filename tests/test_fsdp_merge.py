"""End to end: real FSDP2 / DTensor checkpoints merged, compared with the unsharded model."""

from __future__ import annotations

import hashlib
import json
import zlib

import pytest
import torch
from helpers import (
    assert_tensors_equal, folder_tensors, model_logits, no_leftovers, quantized_base_config, read_json, reference_logits,
    run_cli,
)

import hf_merge
from hf_merge.transformers_compat import dtype_key

LAYOUT_FIXTURES = [
    pytest.param("qwen2_fp32_ws2", marks=pytest.mark.compat),
    pytest.param("llama_tied_bf16_ws4", marks=pytest.mark.compat),
    "qwen2_shard1",
    "hsdp_ckpt",
    "uneven_ckpt",
    "ws1_ckpt",
    "mixed_buffers_ckpt",
    "shard1_dtensor_ckpt",
    pytest.param("hsdp_fsdp2_ckpt", marks=pytest.mark.compat),
    "uneven_fsdp2_ckpt",
    "ws1_fsdp2_ckpt",
]


@pytest.mark.parametrize("fixture", LAYOUT_FIXTURES)
def test_merge_is_bit_exact_and_logits_equal(fixture, request, tmp_path):
    ckpt = request.getfixturevalue(fixture)
    target = tmp_path / "merged"
    result = hf_merge.merge(ckpt.actor, target, dtype="auto")  # keep the training dtype
    assert_tensors_equal(folder_tensors(target), folder_tensors(ckpt.reference))
    input_ids, want = reference_logits(ckpt)
    dtype = getattr(torch, ckpt.options["train_dtype"])
    got = model_logits(target, input_ids, dtype=dtype)
    if dtype != torch.float32:
        # bf16 matmuls depend on the thread count of the process that ran them: compare with the
        # unsharded model run here, in this process.
        want = model_logits(ckpt.reference, input_ids, dtype=dtype)
    assert torch.equal(got, want) or torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert result.num_tensors == len(folder_tensors(ckpt.reference))
    assert no_leftovers(target)


def test_default_dtype_is_the_configs_with_one_rounding(qwen2_fp32_ws2, tmp_path):
    target = tmp_path / "merged"
    result = hf_merge.merge(qwen2_fp32_ws2.actor, target)
    assert result.dtype == "bfloat16"
    assert read_json(target / "config.json")["dtype"] == "bfloat16"
    assert_tensors_equal(folder_tensors(target), folder_tensors(qwen2_fp32_ws2.reference), dtype=torch.bfloat16)


def test_explicit_dtype_float16(qwen2_fp32_ws2, tmp_path):
    target = tmp_path / "merged"
    hf_merge.merge(qwen2_fp32_ws2.actor, target, dtype="float16")
    assert_tensors_equal(folder_tensors(target), folder_tensors(qwen2_fp32_ws2.reference), dtype=torch.float16)


@pytest.mark.compat
def test_tied_embeddings_written_once(llama_tied_bf16_ws4, tmp_path):
    target = tmp_path / "merged"
    hf_merge.merge(llama_tied_bf16_ws4.actor, target)
    names = folder_tensors(target)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_a_config_that_ties_an_untied_model_is_refused(qwen2_fp32_ws2, tmp_path):
    """An untied checkpoint merged under a config that says tie_word_embeddings: dropping the
    trained lm_head would go unnoticed (the folder loads, with the embeddings as the head)."""
    import shutil

    config = tmp_path / "config"
    shutil.copytree(qwen2_fp32_ws2.hf_dir, config)
    cfg = read_json(config / "config.json")
    assert cfg.get("tie_word_embeddings") is False
    (config / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    target = tmp_path / "merged"
    r = run_cli("merge", str(qwen2_fp32_ws2.actor), str(target), "--config", str(config))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "lm_head.weight differs from its model.embed_tokens.weight" in lines[0], r.stderr
    assert "tie_word_embeddings: false" in lines[0]
    assert not target.exists() and no_leftovers(target)


@pytest.mark.compat
def test_a_quantized_base_models_config_is_written_without_its_quantization(qwen2_fp32_ws2, tmp_path):
    """The weights are plain floats; a config.json that still says fp8 made transformers 4.57 refuse
    the folder on CPU ("A GPU or XPU is needed for FP8 quantization") and makes fp8 loaders expect
    weight_scale_inv tensors. save_pretrained of the dequantized model writes no quantization_config."""
    config = quantized_base_config(qwen2_fp32_ws2, tmp_path / "base")
    target = tmp_path / "merged"
    r = run_cli("merge", qwen2_fp32_ws2.actor, target, "--config", config, "--dtype", "auto")
    assert r.returncode == 0, r.stderr
    assert "quantization_config (fp8) left out" in r.stderr, r.stderr
    written = read_json(target / "config.json")
    assert "quantization_config" not in written
    assert written == {k: v for k, v in read_json(config / "config.json").items() if k != "quantization_config"} | {"dtype": "float32", dtype_key(): "float32"}
    input_ids, want = reference_logits(qwen2_fp32_ws2)
    torch.testing.assert_close(model_logits(target, input_ids), want, rtol=0, atol=1e-6)


@pytest.mark.compat
def test_side_files_copied(qwen2_fp32_ws2, tmp_path):
    target = tmp_path / "merged"
    hf_merge.merge(qwen2_fp32_ws2.actor, target)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (target / name).read_bytes() == (qwen2_fp32_ws2.hf_dir / name).read_bytes()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    assert len(tok("hello world")["input_ids"]) > 0
    prov = read_json(target / "hf_merge.json")
    assert prov["source"]["world_size"] == 2 and prov["source"]["format"] == "fsdp"


def test_many_files_with_index_load_in_transformers(qwen2_fp32_ws2, tmp_path):
    target = tmp_path / "merged"
    max_bytes = 20_000
    hf_merge.merge(qwen2_fp32_ws2.actor, target, dtype="auto", max_shard_size=max_bytes)
    files = sorted(target.glob("model-*.safetensors"))
    assert len(files) > 2
    index = read_json(target / "model.safetensors.index.json")
    tensors = folder_tensors(target)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == {f.name for f in files}
    for f in files:
        with open(f, "rb") as fh:
            header = int.from_bytes(fh.read(8), "little")
        data = f.stat().st_size - 8 - header
        single = len([k for k, v in index["weight_map"].items() if v == f.name]) == 1
        assert data <= max_bytes or single, f"{f.name} holds {data} bytes"
    input_ids, want = reference_logits(qwen2_fp32_ws2)
    assert torch.allclose(model_logits(target, input_ids), want, atol=1e-5, rtol=0)


def test_parallel_workers_write_identical_files(qwen2_fp32_ws2, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    hf_merge.merge(qwen2_fp32_ws2.actor, one, max_shard_size=20_000, workers=1)
    hf_merge.merge(qwen2_fp32_ws2.actor, two, max_shard_size=20_000, workers=3, checksums="sha256")
    files = sorted(p.name for p in one.glob("*.safetensors"))
    assert files == sorted(p.name for p in two.glob("*.safetensors"))
    for name in files:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    # the checksum computed while writing (a CRC-32 in one process, a sha256 in forked writers) is the file's
    recorded = {f.name: {n: d for n, d in json.loads((f / "hf_merge.json").read_text())["files"].items() if n in files}
                for f in (one, two)}
    assert recorded["one"] == {n: f"crc32:{zlib.crc32((one / n).read_bytes()):08x}" for n in files}
    assert recorded["two"] == {n: hashlib.sha256((two / n).read_bytes()).hexdigest() for n in files}


def test_source_resolution_root_step_and_actor(qwen2_fp32_ws2, tmp_path):
    for i, src in enumerate([qwen2_fp32_ws2.root, qwen2_fp32_ws2.step_dir, qwen2_fp32_ws2.actor]):
        proc = run_cli("merge", src, tmp_path / f"m{i}")
        assert proc.returncode == 0, proc.stderr
        if src == qwen2_fp32_ws2.root:
            assert "global_step_1" in proc.stderr  # says which step it chose
    a, b = folder_tensors(tmp_path / "m0"), folder_tensors(tmp_path / "m2")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _stderr_on_a_terminal(*args: str) -> tuple[int, str]:
    """Run hf-merge with its stderr on a pseudo-terminal (where progress bars are drawn)."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_MERGE_DEBUG")}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm sizes the bar to it
    proc = subprocess.Popen([sys.executable, "-m", "hf_merge.cli.app", *map(str, args)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=300), b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_and_quiet_silences_it(qwen2_fp32_ws2, tmp_path):
    rc, err = _stderr_on_a_terminal("merge", qwen2_fp32_ws2.actor, tmp_path / "loud")
    assert rc == 0, err
    assert "Merging" in err and "\r" in err and "wrote" in err  # a tqdm bar, redrawn in place
    # not a terminal (a pipe, a log file): no bar redrawn with \r (plain lines every 30 s instead)
    plain = run_cli("merge", qwen2_fp32_ws2.actor, tmp_path / "plain")
    assert plain.returncode == 0 and "wrote" in plain.stderr and "\r" not in plain.stderr
    quiet = run_cli("merge", qwen2_fp32_ws2.actor, tmp_path / "quiet", "-q")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "" and quiet.stdout == ""
    assert (tmp_path / "quiet" / "model.safetensors").is_file()


def test_verl_spelling_is_accepted(qwen2_fp32_ws2, tmp_path):
    target = tmp_path / "verl_style"
    proc = run_cli("merge", "--backend", "fsdp", "--local_dir", qwen2_fp32_ws2.actor, "--target_dir", target,
                   "--use_cpu_initialization", "--trust-remote-code")
    assert proc.returncode == 0, proc.stderr
    assert "use_cpu_initialization" in proc.stderr  # one-line note that it changes nothing
    assert (target / "model.safetensors").is_file()


def test_config_flag_supplies_missing_huggingface_folder(qwen2_fp32_ws2, tmp_path):
    import shutil

    actor = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, actor, ignore=shutil.ignore_patterns("huggingface"))
    proc = run_cli("merge", actor, tmp_path / "out")
    assert "no config.json" in proc.stderr and proc.returncode != 0
    proc = run_cli("merge", actor, tmp_path / "out", "--hf_model_path", qwen2_fp32_ws2.hf_dir)
    assert proc.returncode == 0, proc.stderr


def test_missing_fsdp_config_warns_and_reads_file_names(qwen2_fp32_ws2, tmp_path):
    import shutil

    actor = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, actor)
    (actor / "fsdp_config.json").unlink()
    proc = run_cli("merge", actor, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "warning: no fsdp_config.json" in proc.stderr


def test_overwrite_replaces_target(qwen2_fp32_ws2, tmp_path):
    target = tmp_path / "merged"
    target.mkdir()
    (target / "old.txt").write_text("x")
    proc = run_cli("merge", qwen2_fp32_ws2.actor, target, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert not (target / "old.txt").exists() and (target / "model.safetensors").exists()
    assert no_leftovers(target)


def test_inspect_reads_no_tensor_data(hsdp_ckpt):
    proc = run_cli("inspect", hsdp_ckpt.actor, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["format"] == "fsdp"
    assert report["world_size"] == 4
    assert report["mesh"] == [2, 2] and report["mesh_dim_names"] == ["ddp", "fsdp"]
    assert report["ranks_read"] == [0, 1]  # one replica group
    assert report["architecture"] == "Qwen2ForCausalLM"
    assert report["lora"] is None
    ref = folder_tensors(hsdp_ckpt.reference)
    assert report["parameters"] == sum(t.numel() for t in ref.values())
    assert any("Replicate" in p and "Shard" in p for p in report["placements"])


def test_open_checkpoint_reads_into_caller_buffer(qwen2_shard1):
    ckpt = hf_merge.open_checkpoint(qwen2_shard1.actor)
    ref = folder_tensors(qwen2_shard1.reference)
    name = "model.embed_tokens.weight"
    out = torch.full(ckpt.specs()[name].shape, float("nan"), dtype=torch.float32)
    ckpt.read_into(name, out)
    assert torch.equal(out, ref[name])
    assert "Shard(dim=1)" in ckpt.placements()[name]
