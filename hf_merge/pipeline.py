"""The merge pipeline: one ``Output`` protocol (plan -> write -> finish), driven by any executor.

An output is what a merge produces from the views of a source (:mod:`hf_merge.transforms.views`):

- :class:`hf_merge.merging.HfFolder`: a Hugging Face model folder (safetensors, index, config, side
  files, card), with the PEFT adapter in ``lora_adapter/`` for ``--lora both``;
- :class:`hf_merge.merging.PeftAdapter`: a PEFT adapter folder (``--lora adapter``, or nested above);
- :class:`hf_merge.gguf.convert.GgufFile`: one GGUF file for llama.cpp (and its LoRA file);
- :class:`Fill`: the in-memory fill behind ``from_sharded_pretrained`` (the model's own tensors).

``plan()`` lists the files the output writes (:class:`Unit`-like: ``name``, ``data_size``, ``header``),
from specs alone, the same on every rank; ``write(folder, units, how)`` writes any share of them and
returns ``{name: digest or None}``; ``finish(folder, digests)`` writes the rest (index, config,
provenance with the digests, card), once. Executors:

- :func:`run_in_process`: plan, write every unit here, finish (the fill; the nested adapter);
- :func:`run_staged`: the same inside an atomic target folder (:mod:`hf_merge.write.atomic`), where a
  safetensors output's ``write`` forks writers (:func:`hf_merge.write.shards.write_shards`);
- :meth:`hf_merge.write.distributed.Job.merge`: every rank plans, the writing ranks write a share of the
  units, rank 0 finishes and commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from .options import MergeOptions

ProgressFn = Callable[[int], None]


@dataclass(frozen=True)
class Unit:
    """One file an output writes that has no safetensors :class:`~hf_merge.write.plan.FilePlan`: its name,
    the bytes it holds (how executors balance shares) and what fingerprints it across ranks."""

    name: str
    data_size: int
    header: bytes = b""


@dataclass(frozen=True)
class Writing:
    """How an executor asks an output to write its share."""

    workers: int | None = None  # writing processes (None: the output's default)
    checksum: str | None = None  # return each file's digest of this kind (hf_merge.write.digest)
    progress: ProgressFn | None = None  # bytes written, reported here (None: the output shows its own bar)
    processes_here: int = 1  # writing processes of this job on this machine (they share its CPUs)
    head: Any = None  # the CLI's head start (hf_merge.write.head_start), for the first safetensors file


class Output(Protocol):
    def plan(self) -> Sequence[Any]: ...

    def write(self, folder: Path | None, units: Sequence[Any], how: Writing) -> dict[str, str | None]: ...

    def finish(self, folder: Path | None, digests: dict[str, str | None]) -> None: ...


@dataclass
class MergeResult:
    target: Path
    files: list[str]
    dtype: str | None
    num_tensors: int
    total_bytes: int
    notes: list[str] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)
    url: str | None = None  # the Hub URL when pushed
    quantization: str | None = None  # nf4 / fp4 / int8 (bitsandbytes), or the --gguf type (q8_0, ...)
    adapter: dict[str, Any] | None = None  # LoRA "both": the adapter folder's path, tensors, bytes, dtype
    rank: int = 0  # a distributed merge's rank (rank 0 finishes the folder and reports)


def run_in_process(output: Output, folder: Path | None, how: Writing = Writing()) -> dict[str, str | None]:
    """Plan, write every unit in this process, finish; the digests."""
    digests = output.write(folder, list(output.plan()), how)
    output.finish(folder, digests)
    return digests


def run_staged(prepare: Callable[[], Any], target: Path, options: MergeOptions, *, overwrite: bool, head: Any = None) -> Any:
    """The in-process executor of a merge: lock ``target`` and make its temporary folder (before the
    source is read, so a second run on the same target is refused before it reads anything),
    ``prepare()`` the output, write and finish it there (``options``: the merge's
    :class:`~hf_merge.options.MergeOptions`), move the folder into place; the output."""
    from .write.atomic import atomic_folder
    from .publish.preload import preload

    how = Writing(workers=options.workers, checksum=options.checksum(), head=head)

    with atomic_folder(target, overwrite=overwrite) as tmp:
        output = prepare()
        card_imports = preload(first=warm_up(output))  # the card's imports and the output's, while the weights are written
        try:
            digests = output.write(tmp, list(output.plan()), how)
            card_imports.join()
            output.finish(tmp, digests)
        finally:
            output.close()
    return output


def warm_up(output: Any) -> "Callable[[], None] | None":
    """The output's own imports for its finish (``warm_up()``, where it has one), or None."""
    method = getattr(output, "warm_up", None)
    return method() if method is not None else None


def pushed(result: MergeResult, push_to_hub: str | None, private: bool | None) -> MergeResult:
    """``result`` with the finished folder uploaded to ``push_to_hub`` (when given)."""
    if push_to_hub:
        from .errors import HfMergeError, HubError
        from .publish.hub import push

        try:
            result.url = push(result.target, push_to_hub, private=private)
        except HfMergeError as e:
            raise HubError(
                f"{e} -- the merged folder {result.target} was written; retry the upload with: "
                f"hf-merge push {result.target} {push_to_hub}"
            ) from e
    return result


class Fill:
    """The in-memory output of ``from_sharded_pretrained``: one unit, the model's tensors, read into
    place by ``fill`` (:func:`hf_merge.load.model._fill`); nothing to finish, no folder."""

    def __init__(self, fill: Callable[[], None], nbytes: int = 0):
        self._fill, self._nbytes = fill, nbytes

    def plan(self) -> list[Unit]:
        return [Unit("model", self._nbytes)]

    def write(self, folder: Path | None, units: Sequence[Any], how: Writing) -> dict[str, str | None]:
        if units:
            self._fill()
        return {}

    def finish(self, folder: Path | None, digests: dict[str, str | None]) -> None:
        pass
