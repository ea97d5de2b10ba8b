"""Verify a merged folder: against its source checkpoint (exact) or a reference HF folder (tolerances).

Both sides are lazy checkpoints and are compared one tensor at a time, so memory stays flat.
Against a source, the expected tensors are recomputed through the same transform stack the merge
used (names, tied alias, LoRA fusion, dtype cast, and bitsandbytes quantization with the options
recorded in hf_merge.json), so the check is exact: bit-equal for the same dtype, exactly the one
rounding of the cast otherwise, byte-equal quantized parts. Against an HF folder, values are compared
in float32 with ``atol``/``rtol`` and every difference is reported, not only the first.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .checkpoint import LazyCheckpoint, detect_backend, open_checkpoint
from .errors import HfMergeError, UnsupportedCheckpointError, VerificationError
from .progress import count
from .readers.file_runs import values
from .readers.formats import is_hf_folder
from .transformers_compat import dtype_kwargs
from .write import digest
from .write.atomic import PROVENANCE_FILE

ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    why: str = ""  # a failed check's reason, shown in the one-line verdict (:meth:`VerifyReport.summary`)


@dataclass
class VerifyReport:
    target: Path
    against: str
    checks: list[Check] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # shown before the table (e.g. the dtypes differ)
    rank: int = 0  # a distributed verification's rank: every rank holds the same report, rank 0 prints it

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str = "", why: str = "") -> None:
        self.checks.append(Check(name, ok, detail, why))

    def table(self) -> str:
        width = max(len(c.name) for c in self.checks) if self.checks else 5
        rows = [f"note: {n}" for n in self.notes]
        rows += [f"{'check':<{width}}  result  detail"]
        rows += [f"{c.name:<{width}}  {'ok' if c.ok else 'FAIL':<6}  {c.detail}" for c in self.checks]
        rows += [f"  - {m}" for m in self.mismatches[:50]]
        if len(self.mismatches) > 50:
            rows.append(f"  ... and {len(self.mismatches) - 50} more")
        return "\n".join(rows)

    def summary(self) -> str:
        failed = [c.name + (f" ({c.why})" if c.why else "") for c in self.checks if not c.ok]
        return "all checks passed" if not failed else f"failed: {', '.join(failed)}"


class OneProcess:
    """The sharing of a plain verification: this process does every item. (A distributed one shares
    them with :meth:`hf_merge.write.distributed.Job.share`, which has the same signature.)"""

    rank = 0

    def share(self, sizes: list[int], work: Callable[[list[int]], Any]) -> list[Any]:
        return [work(list(range(len(sizes))))]


ONE_PROCESS = OneProcess()


def _on_one_rank(sharer: Any, work: Callable[[], Any]) -> Any:
    """``work()`` on one rank (rank 0); its result on every rank."""
    return next(r for r in sharer.share([1], lambda mine: (work(),) if mine else None) if r is not None)[0]


def file_checksums(folder: Path, recorded: dict[str, str]) -> dict[str, str]:
    """Each named file's digest, of the kind its recorded digest is (:mod:`hf_merge.write.digest`)."""
    return {name: digest.of_file(Path(folder) / name, digest.kind_of(was)) for name, was in recorded.items()}


def _compare_specs(report: VerifyReport, got: LazyCheckpoint, want: LazyCheckpoint, *, check_dtype: bool) -> list[str]:
    g, w = got.specs(), want.specs()
    only_got, only_want = sorted(set(g) - set(w)), sorted(set(w) - set(g))
    report.mismatches += [f"missing tensor {n}" for n in only_want] + [f"unexpected tensor {n}" for n in only_got]
    report.add("tensor names", not only_got and not only_want, f"{len(g)} in target, {len(w)} expected")
    common = sorted(set(g) & set(w))
    bad_shape = [n for n in common if g[n].shape != w[n].shape]
    report.mismatches += [f"{n}: shape {g[n].shape} != {w[n].shape}" for n in bad_shape]
    report.add("shapes", not bad_shape, f"{len(bad_shape)} differ" if bad_shape else "")
    if check_dtype:
        bad_dtype = [n for n in common if g[n].dtype != w[n].dtype]
        report.mismatches += [f"{n}: dtype {g[n].dtype} != {w[n].dtype}" for n in bad_dtype]
        report.add("dtypes", not bad_dtype, f"{len(bad_dtype)} differ" if bad_dtype else "")
    return [n for n in common if n not in bad_shape]


def _units(got: LazyCheckpoint, names: list[str]) -> tuple[list[int], list[list[str]]]:
    """What a distributed verification shares out: the target's files (sizes on disk, as the merge
    shared them; each rank checks whole files), or single tensors when ``got`` is no folder."""
    wanted = set(names)
    if callable(getattr(got, "tensor_files", None)):
        folder = Path(got.info.path)
        groups = [(f, [n for n in held if n in wanted]) for f, held in got.tensor_files().items()]
        return [(folder / f).stat().st_size for f, _ in groups], [g for _, g in groups]
    specs = got.specs()
    return [specs[n].nbytes for n in names], [[n] for n in names]


def _compare_values(
    report: VerifyReport, got, want, names, *, exact: bool, atol: float, rtol: float, cast: bool = False,
    sharer: Any = ONE_PROCESS, read_archives: Callable[[], list] | None = None,
) -> list:
    """``cast``: read ``got`` in ``want``'s dtype first (verl's ``test``: one rounding, then tolerances).
    ``sharer``: who compares which files (see :class:`OneProcess`); the report sums every rank's.
    ``read_archives``: asked on each rank after its comparisons; returns the union of its answers."""
    sizes, groups = _units(got, names)
    order = {n: i for i, n in enumerate(names)}

    def work(mine: list[int]) -> dict[str, Any]:
        stats = _value_stats(got, want, [n for i in mine for n in groups[i]], exact=exact, atol=atol, rtol=rtol,
                             cast=cast, show=sharer.rank == 0)
        stats["archives"] = read_archives() if read_archives is not None else []
        return stats

    parts = sharer.share(sizes, work)
    bad = sorted((b for part in parts for b in part["bad"]), key=lambda b: order[b[0]])
    nonfinite = sorted((n for part in parts for n in part["nonfinite"]), key=order.__getitem__)
    worst = max([part["worst"] for part in parts] + [0.0])
    report.mismatches += [m for _, m in bad] + [f"{n}: has inf/nan" for n in nonfinite]
    detail = "bit-exact" if exact else f"max abs diff {worst:.3g}"
    report.add("values", not bad, f"{len(bad)} of {len(names)} differ" if bad else f"{len(names)} tensors, {detail}")
    report.add("finite", not nonfinite, f"{len(nonfinite)} tensors with inf/nan" if nonfinite else "")
    return sorted({tuple(a) for part in parts for a in part["archives"]}, key=str)


#: a tensor larger than this is compared band by band of rows, both sides streamed (``read_rows``):
#: memory stays flat with the model's size (a whole 3.1 GB model's embedding pair took 4.7 GB)
BAND_BYTES = 32 << 20


def _bands(got, want, name: str, a_dtype: torch.dtype, b_dtype: torch.dtype):
    """``(a, b)``: tensor ``name`` of ``got`` in ``a_dtype`` and of ``want`` in ``b_dtype``, whole, or,
    when it is large and both sides stream it, as matching bands of rows of at most :data:`BAND_BYTES`
    (each valid until the next is asked for)."""
    spec = got.specs()[name]
    if spec.nbytes > BAND_BYTES and spec.shape and spec.shape[0]:
        rows_a, rows_b = got.read_rows(name, a_dtype), want.read_rows(name, b_dtype)
        if rows_a is not None and rows_b is not None:
            row_bytes = max(1, spec.nbytes // spec.shape[0])
            yield from _aligned((values(p) for _, p in rows_a), (values(p) for _, p in rows_b), max(1, BAND_BYTES // row_bytes))
            return
    yield got.read(name, dtype=a_dtype), want.read(name, dtype=b_dtype)


def _aligned(pieces_a, pieces_b, most: int):
    """Equal row ranges of two streams of row pieces, at most ``most`` rows each."""
    a = b = None
    while True:
        if a is None or not a.shape[0]:
            a = next(pieces_a, None)
        if b is None or not b.shape[0]:
            b = next(pieces_b, None)
        if a is None or b is None:
            if a is not None or b is not None:
                raise ValueError("the two sides hold different numbers of rows")
            return
        n = min(a.shape[0], b.shape[0], most)
        yield a[:n], b[:n]
        a, b = a[n:], b[n:]


def _value_stats(got, want, names, *, exact: bool, atol: float, rtol: float, cast: bool, show: bool) -> dict[str, Any]:
    """Compare ``names``: ``{"bad": [(name, line)], "worst": max abs diff, "nonfinite": [name]}``."""
    from .progress import progress_bar

    bad, worst, nonfinite = [], 0.0, []
    for name in progress_bar(names, desc="Verifying", unit="tensor") if show else names:
        spec, want_dtype = got.specs()[name], want.specs()[name].dtype
        a_dtype = want_dtype if cast and spec.dtype.is_floating_point else spec.dtype
        differs, diff, finite = False, 0.0, True
        for a, b in _bands(got, want, name, a_dtype, spec.dtype if exact else want_dtype):
            if exact:
                if not torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b):
                    differs = True
                    if a.numel() and a.is_floating_point():
                        diff = max(diff, (a.double() - b.double()).abs().max().item())
                    else:
                        diff = float("nan")  # no difference of values to give
            elif a.numel() and not (a.dtype == b.dtype and torch.equal(a, b)):  # equal: nothing to measure
                fa, fb = a.float(), b.float()
                diff = max(diff, (fa - fb).abs().max().item())
                differs |= not torch.allclose(fa, fb, atol=atol, rtol=rtol, equal_nan=True)
                del fa, fb
            if finite and a.is_floating_point() and a.numel() and not torch.isfinite(a).all():
                finite = False
            del a, b
        if not exact:
            worst = max(worst, diff)
        if differs:
            bad.append((name, f"{name}: not bit-identical (max abs diff {diff:.3g})" if exact
                        else f"{name}: max abs diff {diff:.3g} > atol {atol} / rtol {rtol}"))
        if not finite:
            nonfinite.append(name)
    return {"bad": bad, "worst": worst, "nonfinite": nonfinite}


def verify(
    target: "str | Path",
    against: "str | Path | None" = None,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    logits: bool = False,
    logits_atol: float = 1e-3,
    backend: str = "auto",
    config: "str | Path | None" = None,
    lora_alpha: float | None = None,
    use_rslora: bool | None = None,
    base_model: "str | Path | None" = None,
    source_options: dict | None = None,
    distributed: bool | None = None,
) -> VerifyReport:
    """Compare a merged folder with its source checkpoint or a reference HF folder.

    ``target`` may be a model folder, a PEFT adapter folder (``--lora adapter``), or a model
    folder with its adapter in ``lora_adapter/`` (``--lora both``: both are checked). Against an
    HSDP source, the replica groups that a merge does not read are compared with the one it does.
    Returns a report; does not raise on mismatches (see :func:`verify_or_raise`).

    ``source_options``: the reader options (DeepSpeed's ``tag``, ``source_weights``); by default those
    ``hf_merge.json`` recorded, so the source is read as the merge read it (given ones win).

    Without ``against``, only the checksums ``hf_merge.json`` recorded at merge time are checked (a
    copied or downloaded folder, a GGUF output, with no source at hand).

    ``distributed``: as for :func:`hf_merge.merge` (None: yes under torchrun). Each rank then checks
    a share of the target's files, balanced by bytes (their tensors and checksums) and of the source
    archives' CRCs; the results are gathered over gloo, and every rank returns the same report
    (``report.rank`` says which rank this is; rank 0 prints it). A rank's error fails every rank.
    """
    from .write.distributed import join_job

    job = join_job(distributed)
    if job is None:
        return _verify(target, against, atol, rtol, logits, logits_atol, backend, ONE_PROCESS, config=config,
                       lora_alpha=lora_alpha, use_rslora=use_rslora, base_model=base_model, source_options=source_options)
    job.consequence = "the verification did not finish"
    with job:
        report = job.run(lambda: _verify(
            target, against, atol, rtol, logits, logits_atol, backend, job, config=config, lora_alpha=lora_alpha,
            use_rslora=use_rslora, base_model=base_model, source_options=source_options,
        ))
    report.rank = job.rank
    return report


def _verify(target, against, atol, rtol, logits, logits_atol, backend, sharer, *, config, lora_alpha, use_rslora,
            base_model, source_options) -> VerifyReport:
    if against is None:
        return _verify_checksums(Path(target), sharer)
    target, against_path = Path(target), Path(against)
    _refuse_unmerged(target)
    report = VerifyReport(target, str(against))
    kind = backend if backend != "auto" else detect_backend(against_path)
    adapter_only = (target / ADAPTER_CONFIG).is_file() and not (target / "config.json").is_file()
    provenance = _read_provenance(target)
    # the source is read as the merge read it (DeepSpeed's tag, source_weights); options given here win
    recorded = (provenance.get("source") or {}).get("options")
    source_options = {**(recorded if isinstance(recorded, dict) else {}),
                      **{k: v for k, v in (source_options or {}).items() if v is not None}}
    options = dict(
        config=config, lora_alpha=lora_alpha, use_rslora=use_rslora, base_model=base_model, source_options=source_options
    )
    _check_checksums(report, target, provenance, sharer)
    _verify_folder(report, target, against_path, kind, atol, rtol, provenance, sharer, adapter=adapter_only, **options)
    sub = target / "lora_adapter"
    if not adapter_only and (sub / ADAPTER_CONFIG).is_file() and not is_hf_folder(kind):
        _verify_folder(report, sub, against_path, kind, atol, rtol, provenance, sharer, adapter=True, prefix="adapter: ",
                       **options)
    if logits and not adapter_only:
        for check in _on_one_rank(sharer, lambda: _check_logits(target, against_path if is_hf_folder(kind) else None, logits_atol)):
            report.add(*check)
    return report


def _verify_checksums(target: Path, sharer: Any) -> VerifyReport:
    """The checksums recorded at merge time, and nothing else."""
    report = VerifyReport(target, f"the checksums in {PROVENANCE_FILE}")
    provenance = _read_provenance(target)
    if not provenance.get("files"):
        raise HfMergeError(f"{target} has no checksums in {PROVENANCE_FILE} (merged with --checksum none, or not by "
                           "hf-merge): pass --against SOURCE to compare its tensors with the source")
    _check_checksums(report, target, provenance, sharer)
    return report


def _refuse_unmerged(target: Path) -> None:
    """A target without safetensors: a ``--gguf`` output, or the checkpoint given first; say so
    (and what to do) instead of "no *.safetensors"."""
    if not target.is_dir() or any(target.glob("*.safetensors")):
        return
    ggufs = sorted(p.name for p in target.glob("*.gguf"))
    if ggufs:
        raise UnsupportedCheckpointError(
            f"{target} holds a GGUF file ({ggufs[0]}), which verify does not compare (it reads safetensors folders): "
            f"check the checksum {PROVENANCE_FILE} recorded with `hf-merge verify {target}` (no --against), or merge "
            "without --gguf and verify that folder"
        )
    try:
        found = detect_backend(target)
    except (HfMergeError, OSError):
        return
    raise UnsupportedCheckpointError(
        f"{target} is a {found} checkpoint, not a merged folder: hf-merge verify MERGED --against CHECKPOINT"
    )


def _verify_folder(
    report: VerifyReport, folder: Path, against: Path, kind: str, atol: float, rtol: float, provenance: dict[str, Any],
    sharer: Any, *, adapter: bool, prefix: str = "", config=None, lora_alpha=None, use_rslora=None, base_model=None, source_options=None,
) -> None:
    """Add the checks of one folder (a model, or an adapter) to ``report``; names get ``prefix``."""
    from .readers.hf_dir import open_hf_dir

    sub = VerifyReport(folder, report.against)
    got = open_hf_dir(folder)
    try:
        if is_hf_folder(kind):
            want = open_hf_dir(against)
            _note_dtypes(sub, got, want)
            names = _compare_specs(sub, got, want, check_dtype=False)
            _compare_values(sub, got, want, names, exact=False, atol=atol, rtol=rtol, sharer=sharer)
            want.close()
        else:
            _compare_with_source(
                sub, got, folder, against, kind, provenance, sharer, adapter=adapter, config=config,
                lora_alpha=lora_alpha, use_rslora=use_rslora, base_model=base_model, source_options=source_options,
            )
    finally:
        got.close()
    report.notes += sub.notes
    report.checks += [Check(prefix + c.name, c.ok, c.detail, c.why) for c in sub.checks]
    report.mismatches += [prefix + m for m in sub.mismatches]


def _compare_with_source(
    report: VerifyReport, got: LazyCheckpoint, folder: Path, against: Path, kind: str, provenance: dict[str, Any],
    sharer: Any, *, adapter: bool, config, lora_alpha, use_rslora, base_model, source_options=None,
) -> None:
    """Exact check: the expected tensors are rebuilt through the merge's own transform stack."""
    from .hf_files import checkpoint_config
    from .transforms.views import build_views
    from .readers import record_crc

    source = open_checkpoint(against, backend=kind, config=config, base_model=base_model, **(source_options or {}))
    try:
        _, cfg = checkpoint_config(source.info)
        lora_cfg = provenance.get("lora") or {}
        views = build_views(
            source, cfg, dtype=provenance.get("dtype_option") or provenance.get("dtype") or "config",
            lora="adapter" if adapter else "fuse",
            lora_alpha=lora_alpha if lora_alpha is not None else lora_cfg.get("lora_alpha"),
            use_rslora=use_rslora if use_rslora is not None else lora_cfg.get("use_rslora"),
            base_model=base_model, base_model_name=provenance.get("base_model"),
        )
        expected = views.adapter if adapter else views.model
        if adapter:
            _check_adapter_config(report, folder, views.adapter_config)
        elif provenance.get("quantization"):
            expected = _requantized(expected, cfg, provenance["quantization"])
            report.add("quantization", True, f"re-quantized: {provenance['quantization'].get('mode')}")
        names = _compare_specs(report, got, expected, check_dtype=True)
        with record_crc.skipping():  # the source records' CRC-32 is reported below, as a row of its own
            archives = _compare_values(report, got, expected, names, exact=True, atol=0, rtol=0, sharer=sharer,
                                       read_archives=lambda: _zip_archives(source))
        if not adapter:
            _check_replicas(report, source, sharer)
        _check_source_crcs(report, archives, sharer)
    finally:
        source.close()


def _check_replicas(report: VerifyReport, source: LazyCheckpoint, sharer: Any = ONE_PROCESS) -> None:
    """HSDP (and buffers every rank saved): the copies a merge does not read must equal those it does."""
    if not hasattr(source, "replica_differences"):
        return
    compared, differ = _on_one_rank(sharer, source.replica_differences)
    if compared:
        report.mismatches += differ
        report.add("replicas", not differ, f"{len(differ)} of {compared} replica copies differ" if differ
                   else f"{compared} copies not merged (HSDP replicas, buffers) equal the merged ones")


def _check_adapter_config(report: VerifyReport, folder: Path, expected: dict[str, Any]) -> None:
    path = folder / ADAPTER_CONFIG
    try:
        written = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        report.mismatches.append(f"{ADAPTER_CONFIG}: not readable ({e})")
        report.add(ADAPTER_CONFIG, False, "not readable")
        return
    keys = sorted(set(expected) | set(written))
    differ = [k for k in keys if _json_norm(written.get(k)) != _json_norm(expected.get(k))]
    report.mismatches += [f"{ADAPTER_CONFIG}: {k} is {written.get(k)!r}, the checkpoint gives {expected.get(k)!r}" for k in differ]
    report.add(ADAPTER_CONFIG, not differ, f"{len(differ)} fields differ" if differ else f"r={expected.get('r')}, "
               f"lora_alpha={expected.get('lora_alpha')}, {len(expected.get('target_modules') or [])} target modules")


def _json_norm(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True)) if value is not None else None


def _note_dtypes(report: VerifyReport, got: LazyCheckpoint, want: LazyCheckpoint) -> None:
    """Against an HF folder, say first when the two sides are in different dtypes."""
    from .hf_files import written_dtype
    from .spec import dtype_name

    a, _ = written_dtype(got.specs())
    b, _ = written_dtype(want.specs())
    if a is not None and b is not None and a != b:
        low = max(a, b, key=lambda d: torch.finfo(d).eps)  # the coarser of the two
        eps = torch.finfo(low).eps / 2  # one rounding: half an ulp, relative
        report.notes.append(
            f"the dtypes differ: target {dtype_name(a)}, reference {dtype_name(b)}; values are compared in float32, "
            f"so a cast leaves differences of one {dtype_name(low)} rounding (pass --rtol {eps:.2g} to allow it)"
        )


def check_source(
    source: "str | Path",
    reference: "str | Path",
    *,
    atol: float = 1e-6,
    rtol: float = 1e-6,
    backend: str = "auto",
    config: "str | Path | None" = None,
    lora_alpha: float | None = None,
    use_rslora: bool | None = None,
    base_model: "str | Path | None" = None,
) -> VerifyReport:
    """verl's ``model_merger test``: the checkpoint, merged in memory (nothing written), against an
    HF folder. Each source tensor is read in the reference's dtype (one rounding, as verl casts
    both sides), then compared within ``atol``/``rtol``; names and shapes must match."""
    from .hf_files import checkpoint_config
    from .transforms.views import model_view
    from .readers.hf_dir import open_hf_dir

    report = VerifyReport(Path(source), str(reference))
    ckpt = open_checkpoint(Path(source), backend=backend, config=config, base_model=base_model)
    want = open_hf_dir(Path(reference))
    try:
        _, cfg = checkpoint_config(ckpt.info)
        view, _, _ = model_view(ckpt, cfg, dtype="auto", lora_alpha=lora_alpha, use_rslora=use_rslora, base_model=base_model)
        names = _compare_specs(report, view, want, check_dtype=False)
        _compare_values(report, view, want, names, exact=False, atol=atol, rtol=rtol, cast=True)
        _check_replicas(report, ckpt)
    finally:
        want.close()
        ckpt.close()
    return report


def _zip_archives(view: Any, depth: int = 0) -> list:
    """The torch.save archives under a stack of lazy views whose bytes a merge uses: readers expose
    ``read_archives()`` (those read so far, where files also hold what no merge reads, as DCP's
    optimizer state) or ``zip_archives()`` (all of them)."""
    if depth > 12:
        return []
    if callable(getattr(view, "read_archives", None)):
        found = list(view.read_archives())
    else:
        found = list(view.zip_archives()) if callable(getattr(view, "zip_archives", None)) else []
    for value in vars(view).values() if hasattr(view, "__dict__") else ():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, LazyCheckpoint):
                found += _zip_archives(item, depth + 1)
    return sorted(set(found), key=str)


def _check_source_crcs(report: VerifyReport, archives: list, sharer: Any = ONE_PROCESS) -> None:
    """Every record of the source torch.save ``archives`` the merge reads (:func:`_zip_archives`) against
    the CRC-32 in its zip directory: corruption in a source (which the merge copied faithfully) is found here."""
    from .readers.torch_zip import archive_crc_mismatches

    if not archives:
        return
    sizes = [length if length is not None else os.path.getsize(path) - start for path, start, length in archives]
    parts = sharer.share(sizes, lambda mine: archive_crc_mismatches([archives[i] for i in mine]))
    checked, bad = sum(c for c, _ in parts), [b for _, part in parts for b in part]
    report.mismatches += bad
    report.add("source CRC-32", not bad, f"{count(checked, 'record')} in {count(len(archives), 'archive')}" + (f", {len(bad)} bad" if bad else ""))


def _requantized(view: LazyCheckpoint, config: dict[str, Any], recorded: dict[str, Any]) -> LazyCheckpoint:
    """``view`` quantized again with the options the merge recorded (bitsandbytes is deterministic on
    the same weights, so a correct output is byte-identical to this)."""
    from .transforms.quantize import QuantizeOptions, Quantized

    if recorded.get("method") != "bitsandbytes":
        raise HfMergeError(f"cannot verify {recorded.get('method')!r} quantization; hf_merge.json was not written by this version")
    mode = recorded.get("mode")
    options = QuantizeOptions(
        mode,
        double_quant=bool(recorded.get("double_quant")),
        compute_dtype=recorded.get("compute_dtype") if mode != "int8" else None,
        skip_modules=tuple(recorded.get("skip_modules") or ()),
    )
    return Quantized(view, config, options)


def verify_or_raise(target, against, *, shown_as=None, next_step: str | None = None, **kwargs) -> VerifyReport:
    """:func:`verify`, raising :class:`VerificationError` on a mismatch. ``shown_as``: the folder the
    message names (a merge verifies its temporary folder, gone when the error is read);
    ``next_step``: what the message tells to do (default: the ``hf-merge verify`` command)."""
    report = verify(target, against, **kwargs)
    if not report.ok:
        first = report.mismatches[0] if report.mismatches else report.summary()
        step = next_step or f"run `hf-merge verify {target} --against {against}` for the full table"
        raise VerificationError(f"{shown_as or target} does not match {against}: {report.summary()} ({first}); {step}")
    return report


def _read_provenance(target: Path) -> dict[str, Any]:
    path = target / PROVENANCE_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}


def _check_checksums(report: VerifyReport, target: Path, provenance: dict[str, Any], sharer: Any = ONE_PROCESS) -> None:
    recorded = provenance.get("files") or {}
    if not recorded:
        return
    missing = [n for n in recorded if not (target / n).is_file()]
    present = sorted(n for n in recorded if n not in missing)  # the order and sizes the values check shares
    parts = sharer.share([(target / n).stat().st_size for n in present],
                         lambda mine: file_checksums(target, {present[i]: recorded[present[i]] for i in mine}))
    actual = {n: h for part in parts for n, h in part.items()}
    bad = [n for n, h in actual.items() if h != recorded[n]]
    report.mismatches += [f"{n}: {digest.kind_of(recorded[n])} differs from the one recorded at merge time" for n in bad]
    report.mismatches += [f"{n}: recorded at merge time but missing" for n in missing]
    why = "; ".join(f"{_names(names)} {what}" for names, what in ((sorted(bad), "changed since the merge"),
                                                                   (missing, "missing")) if names)
    detail = ", ".join(f"{len(n)} {w}" for n, w in ((bad, "changed"), (missing, "missing")) if n)
    report.add("file checksums", not bad and not missing, detail or count(len(recorded), "file"), why)


def _names(names: list[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _check_logits(target: Path, reference: Path | None, atol: float) -> list[tuple[str, bool, str]]:
    """The logits checks, as ``(name, ok, detail)``."""
    from transformers import AutoModelForCausalLM

    from ._quiet import no_hub_kernels, quiet_bitsandbytes

    quiet_bitsandbytes()

    def run(folder: Path) -> torch.Tensor:
        try:
            quantized = "quantization_config" in json.loads((folder / "config.json").read_text())
        except (OSError, ValueError, TypeError):
            quantized = False  # from_pretrained says what is wrong
        if quantized:
            # import bitsandbytes before transformers does, without its Hub kernel request
            with contextlib.suppress(ImportError), no_hub_kernels():
                import bitsandbytes  # noqa: F401
        model = AutoModelForCausalLM.from_pretrained(folder, **dtype_kwargs(torch.float32)).eval()
        vocab = model.config.get_text_config().vocab_size
        ids = (torch.arange(16).reshape(2, 8) * 7919) % vocab
        with torch.no_grad():
            return model(ids).logits

    got = run(target)
    finite = bool(torch.isfinite(got).all())
    checks = [("logits finite", finite, f"shape {tuple(got.shape)}")]
    if reference is not None:
        diff = (got - run(reference)).abs().max().item()
        hint = "" if diff <= atol else "; a larger --logits-atol allows it"
        checks.append(("logits vs reference", diff <= atol, f"max abs diff {diff:.3g} (limit {atol}{hint})"))
    return checks
