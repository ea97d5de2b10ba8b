"""A pytest plugin: the CPU seconds of every test (this process and the children it reaped, with
``os.times()``), split into setup / call / teardown, as JSON lines; then the files and tests that
took most.

    PYTHONPATH=.:benchmarks .venv/bin/python -m pytest -p pytest_cpu -m "not slow" tests
    PYTEST_CPU_OUT=/tmp/cpu.jsonl ...        (default: pytest-cpu.jsonl in the current folder)

A session fixture is paid by the first test that asks for it (its setup); a fixture writer that
runs under a fork server that outlives the test is not counted (see tree_cpu.py).
"""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

_records: list[dict] = []


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001
    rec = {"id": item.nodeid}
    item.stash[_KEY] = rec
    c0, w0 = _cpu(), time.perf_counter()
    yield
    rec["cpu"], rec["wall"] = _cpu() - c0, time.perf_counter() - w0
    _records.append(rec)


def _phase(name: str):
    @pytest.hookimpl(hookwrapper=True)
    def hook(item):
        c0 = _cpu()
        yield
        item.stash[_KEY][name] = _cpu() - c0

    return hook


_KEY = pytest.StashKey[dict]()
pytest_runtest_setup = _phase("setup")
pytest_runtest_call = _phase("call")
pytest_runtest_teardown = _phase("teardown")


def pytest_terminal_summary(terminalreporter):
    if not _records:
        return
    with open(os.environ.get("PYTEST_CPU_OUT", "pytest-cpu.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _records)
    per_file: dict[str, float] = collections.Counter()
    for r in _records:
        per_file[r["id"].split("::")[0]] += r["cpu"]
    tr = terminalreporter
    tr.write_sep("=", f"CPU seconds: {sum(r['cpu'] for r in _records):.1f} in {len(_records)} tests")
    for name, cpu in per_file.most_common(10):
        tr.write_line(f"{cpu:7.1f}  {name}")
    for r in sorted(_records, key=lambda r: -r["cpu"])[:10]:
        tr.write_line(f"{r['cpu']:7.1f}  {r['id']}  (setup {r.get('setup', 0):.1f})")
