"""Shared assertions for tests: compare a merged folder with a reference, tensor by tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from hf_merge.transformers_compat import dtype_kwargs


def dcp_no_dist() -> dict:
    """``no_dist=True`` for ``torch.distributed.checkpoint.save`` / ``load`` in one process where torch
    has the argument; torch 2.6 has none and saves or loads in one process when no group is initialized."""
    import inspect

    import torch.distributed.checkpoint as dcp

    return {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}


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

    model = AutoModelForCausalLM.from_pretrained(folder, **dtype_kwargs(dtype))
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


def reference_logits(ckpt) -> tuple[torch.Tensor, torch.Tensor]:
    ref = torch.load(ckpt.logits, weights_only=True)
    return ref["input_ids"], ref["logits"]


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, in_process: bool | None = None) -> subprocess.CompletedProcess:
    """Run ``hf-merge ARGS`` and return its exit status, stdout and stderr.

    In this process (``hf_merge.cli.app.main``, output captured) unless ``env`` is given: a fresh
    interpreter costs seconds (torch, transformers) and only tests of the process boundary itself
    (environment read at import, signals, the installed script) need it. ``in_process=True`` with
    ``env`` sets those variables in this process for the call (for variables read at run time).
    """
    if in_process or (in_process is None and env is None):
        return _run_in_process(args, env or {})
    full_env = {k: v for k, v in os.environ.items() if k != "HF_MERGE_DEBUG"}
    full_env.update({"HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})})
    full_env = {k: v for k, v in full_env.items() if v is not None}  # env={"X": None} unsets X
    return subprocess.run(
        [sys.executable, "-m", "hf_merge.cli.app", *map(str, args)],
        capture_output=True, text=True, env=full_env, timeout=timeout,
    )


def _run_in_process(args, env: dict) -> subprocess.CompletedProcess:
    """``app.main`` with stdout/stderr captured; the process state it changes is put back (logging
    handlers, signal handlers, huggingface_hub's progress-bar switch)."""
    import contextlib
    import io
    import logging
    import signal

    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    from hf_merge.cli import app

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    log = logging.getLogger("hf_merge")
    saved_log = (log.handlers[:], log.level, log.propagate)
    signals = [s for s in (signal.SIGTERM, getattr(signal, "SIGPIPE", None)) if s is not None]
    saved_signals = {s: signal.getsignal(s) for s in signals}
    bars_disabled = are_progress_bars_disabled()
    saved_env = {k: os.environ.get(k) for k in {"HF_MERGE_DEBUG", *env}}
    os.environ.pop("HF_MERGE_DEBUG", None)
    os.environ.update({k: str(v) for k, v in env.items() if v is not None})
    for k in [k for k, v in env.items() if v is None]:
        os.environ.pop(k, None)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = app.main(argv)
            except SystemExit as e:  # argparse: usage errors (2), --help / --version (0)
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        log.handlers[:], log.level, log.propagate = saved_log
        for s, handler in saved_signals.items():
            signal.signal(s, handler)
        if not bars_disabled:
            enable_progress_bars()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["hf-merge", *argv], rc, out.getvalue(), err.getvalue())


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The CLI's one error line (asserting there is exactly one and no traceback)."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# The Hub's config of an fp8 base model (Qwen3-8B-FP8, DeepSeek-V3 style): training dequantizes it
# (transformers drops quantization_config from the model's config), so the checkpoint holds plain weights.
FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def quantized_base_config(ckpt, folder) -> Path:
    """``--config`` / ``--hf_model_path`` pointing at the base model's Hub folder, whose config.json
    names the quantization the base was published in."""
    import shutil

    folder = Path(folder)
    shutil.copytree(ckpt.hf_dir, folder)
    cfg = read_json(folder / "config.json")
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": FP8_QUANTIZATION}, indent=2))
    return folder


def no_leftovers(target: Path) -> bool:
    """Nothing named after ``target`` next to it (temporary or old folders)."""
    target = Path(target)
    return not [p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.hf-merge-")]


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# A merge in a fresh interpreter, reporting which optional heavy modules it imported. hub_layout
# is bypassed unless asked for: its transformers import (which imports torch.distributed.tensor)
# is cut elsewhere.
_FRESH_MERGE = """
import importlib, json, sys
if sys.argv[1] == "bypass":
    hl = importlib.import_module("hf_merge.transforms.hub_layout")
    hl.hub_layout = lambda model, config: (model, [])
from hf_merge.cli.app import main
code = main(sys.argv[3:])
print(json.dumps({"code": code, **{m: m in sys.modules for m in sys.argv[2].split(",")}}))
"""


def fresh_merge_imports(argv: list[str], modules: list[str], *, hub_layout: bool = False, env: dict | None = None) -> dict:
    """Run ``hf-merge ARGV`` in a new interpreter: ``{"code": exit code, module: imported?}``.
    ``hub_layout=True`` runs the real Hub-layout step; ``env``: more environment variables."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), **(env or {}))
    mode = "real" if hub_layout else "bypass"
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_MERGE, mode, ",".join(modules), *map(str, argv)], capture_output=True, text=True, env=env,
        timeout=300,
    )
    assert proc.stdout.strip(), proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def processes() -> Iterator[tuple[int, list[str]]]:
    """``(pid, fields)`` of every process, ``fields`` being /proc/PID/stat after the command name
    (state, ppid, pgrp, ...)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            yield int(entry.name), stat[stat.rindex(")") + 2 :].split()


def detections_differing_from_every_probe(root: Path) -> list[str]:
    """For ``root`` and every folder below it: where :func:`~hf_merge.readers.formats.detect`, which
    probes only the formats whose marks are there, matches other formats than asking every probe
    does (the detection before marks). Empty when the marks hide no format anywhere."""
    from hf_merge.errors import SourceNotFoundError, UnsupportedCheckpointError
    from hf_merge.readers import formats

    every = list(formats.registry().values())
    differing = []
    for folder, _, _ in os.walk(root):
        want = tuple(f.name for f in every if formats._probe(f, Path(folder)))
        try:
            got = formats.detect(folder).matched
        except (SourceNotFoundError, UnsupportedCheckpointError):
            got = ()
        if got != want:
            differing.append(f"{folder}: detect {got}, every probe {want}")
    return differing


def incomplete_newest_step(newest: Path, complete: Path) -> str:
    """The one line that refuses a save root whose newest step ``newest`` is empty or incomplete
    (``readers.step_choice``), naming the ``complete`` step to pass."""
    return (f"{newest} is empty or incomplete (a run stopped while saving it?); the newest complete step is "
            f"{complete.name}: pass {complete} to merge it")
