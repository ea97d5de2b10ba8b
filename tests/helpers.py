"""Shared assertions for tests: compare a merged folder with a reference, tensor by tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors folder (sharded or not)."""
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def assert_tensors_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None):
    assert sorted(got) == sorted(want), f"key sets differ: only merged {sorted(set(got) - set(want))[:5]}, only reference {sorted(set(want) - set(got))[:5]}"
    for k, w in want.items():
        if dtype is not None and w.is_floating_point():
            w = w.to(dtype)
        g = got[k]
        assert g.dtype == w.dtype, f"{k}: dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{k}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(g, w), f"{k}: values differ (max abs diff {(g.float() - w.float()).abs().max().item()})"


def model_logits(folder: Path, input_ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


def reference_logits(ckpt) -> tuple[torch.Tensor, torch.Tensor]:
    ref = torch.load(ckpt.logits, weights_only=True)
    return ref["input_ids"], ref["logits"]


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``hf-merge`` in a subprocess, as a user would."""
    full_env = {k: v for k, v in os.environ.items() if k != "HF_MERGE_DEBUG"}
    full_env.update({"HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})})
    full_env = {k: v for k, v in full_env.items() if v is not None}  # env={"X": None} unsets X
    return subprocess.run(
        [sys.executable, "-m", "hf_merge.cli.app", *map(str, args)],
        capture_output=True, text=True, env=full_env, timeout=timeout,
    )


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The CLI's one error line (asserting there is exactly one and no traceback)."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def no_leftovers(target: Path) -> bool:
    """Nothing named after ``target`` next to it (temporary or old folders)."""
    target = Path(target)
    return not [p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.hf-merge-")]


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
