"""Shard planning from specs alone: file names, per-file layout and the index, before any read.

Grouping into files is huggingface_hub's ``split_state_dict_into_shards_factory`` (the same greedy
plan ``save_torch_state_dict`` uses), fed with specs instead of tensors. Inside a file tensors are
in the order safetensors' ``save_file`` gives them: by dtype, in the reverse of its ``Dtype`` order
(which falls with the item size), then by name; so the header and data are the bytes ``save_file``
writes, and every tensor's data offset is aligned to its dtype and can be viewed in place in a
memory-mapped output file.

``group`` (optional) names tensors that belong together, e.g. the parts one quantized weight
becomes (packed data, absmax, quant map, quant state): a group is sized as one unit, never split
across files, and kept adjacent inside its file (after the ungrouped tensors), so a consumer can
produce a group's parts from one computation held only while the group is written. Offsets inside
grouped runs may then be unaligned; the writer handles that (``writer.write_file``).

``storage`` (optional) names tensors that ``save_pretrained`` holds as views of one storage (the
experts transformers 5 splits out of one fused tensor): the splitter sizes such a storage once, by
its first tensor, and puts its other tensors in the same file, as it does for real tensors; inside
the file they are ordinary tensors. The order of ``specs`` is the order the splitter sees
(:mod:`hf_merge.write.save_order` gives ``save_pretrained``'s).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..sizes import parse_size
from ..spec import TensorSpec, safetensors_code

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_PATTERN = "model{suffix}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: every file's ``__metadata__``, as ``save_pretrained`` writes it (provenance is in ``hf_merge.json``,
#: so the weight files are byte for byte those ``save_pretrained`` writes)
SAVE_PRETRAINED_METADATA = {"format": "pt"}


GroupFn = Callable[[TensorSpec], "str | None"]
#: ``spec -> (storage name, storage bytes)`` of a tensor that is a view of a shared storage, else None
StorageFn = Callable[[TensorSpec], "tuple[str, int] | None"]


#: safetensors' ``Dtype`` order, of the codes hf-merge writes (measured: ``save_file`` of one tensor
#: of each dtype, safetensors 0.4.3 and 0.8.0, lists them in the reverse of this order)
SAFETENSORS_DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64")
_RANK = {code: i for i, code in enumerate(SAFETENSORS_DTYPE_ORDER)}


def file_order(spec: TensorSpec, group: GroupFn | None = None) -> tuple[Any, ...]:
    """Sort key inside a file: ungrouped tensors as safetensors orders them (dtype, then name), then
    each group's run (item size desc, name)."""
    g = group(spec) if group is not None else None
    if g is None:
        return (0, "", -spec.dtype.itemsize, -_RANK.get(safetensors_code(spec.dtype), -1), spec.name)
    return (1, g, -spec.dtype.itemsize, 0, spec.name)


@dataclass
class FilePlan:
    """One output safetensors file: its header bytes and where each tensor's data starts."""

    name: str
    specs: list[TensorSpec]
    metadata: dict[str, str] = field(default_factory=dict)
    group: GroupFn | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.specs = sorted(self.specs, key=lambda s: file_order(s, self.group))
        header: dict[str, object] = {}
        if self.metadata:
            header["__metadata__"] = dict(self.metadata)
        self.offsets: dict[str, int] = {}
        offset = 0
        for spec in self.specs:
            header[spec.name] = {
                "dtype": safetensors_code(spec.dtype),
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            self.offsets[spec.name] = offset
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # pad so the data section starts 8-byte aligned
        self.header = struct.pack("<Q", len(raw)) + raw
        self.data_size = offset

    @property
    def data_start(self) -> int:
        return len(self.header)

    def placed(self) -> Iterator[tuple[TensorSpec, int]]:
        """Each tensor with the file offset where its bytes start, in file order (checked to lie
        back to back, as the writers fill the file front to back)."""
        expected = self.data_start
        for spec in self.specs:
            start = self.data_start + self.offsets[spec.name]
            if start != expected:
                raise RuntimeError(f"{self.name}: {spec.name} planned at byte {start}, expected {expected}")
            expected = start + spec.nbytes
            yield spec, start

    @property
    def file_size(self) -> int:
        return len(self.header) + self.data_size


@dataclass
class ShardPlan:
    files: list[FilePlan]
    index: dict | None  # the model.safetensors.index.json content, None for a single file

    @property
    def total_size(self) -> int:
        return sum(f.data_size for f in self.files)


def plan_shards(
    specs: "dict[str, TensorSpec] | list[TensorSpec]",
    *,
    max_shard_size: "int | str | None" = None,
    filename_pattern: str = SAFETENSORS_PATTERN,
    group: GroupFn | None = None,
    storage: StorageFn | None = None,
    total_parameters: int | None = None,
) -> ShardPlan:
    """Plan output files from specs. No tensor data is needed.

    ``group(spec)`` returns a group name or None, ``storage(spec)`` a shared storage or None; see
    the module docstring. Without them the plan is the plain, fully aligned one. ``max_shard_size``
    None is the installed transformers' ``save_pretrained`` default. ``total_parameters`` goes into
    the index's metadata, as ``save_pretrained`` writes ``model.num_parameters()`` there.
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    if max_shard_size is None:
        from .shard_size import default_max_shard_size

        max_shard_size = default_max_shard_size()
    by_name = {s.name: s for s in (specs.values() if isinstance(specs, dict) else specs)}
    for spec in by_name.values():
        if safetensors_code(spec.dtype) is None:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} cannot be stored in safetensors")
    # name -> (key, bytes) of what the splitter sizes as one storage: a group, or a storage views share
    shared: dict[str, tuple[tuple[str, str], int]] = {}
    if group is not None:
        group_of = {n: g for n, s in by_name.items() if (g := group(s)) is not None}
        group_bytes: dict[str, int] = {}
        for n, g in group_of.items():
            group_bytes[g] = group_bytes.get(g, 0) + by_name[n].nbytes
        shared.update((n, (("group", g), group_bytes[g])) for n, g in group_of.items())
    if storage is not None:
        shared.update((n, (("storage", st[0]), st[1])) for n, s in by_name.items()
                      if n not in shared and (st := storage(s)) is not None)
    # A group is passed to the splitter as one "shared storage": it sizes the group's first key
    # with the whole group and puts the other keys in the same file.
    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda s: shared[s.name][1] if s.name in shared else s.nbytes,
        get_storage_id=lambda s: shared[s.name][0] if s.name in shared else None,  # else its own storage
        filename_pattern=filename_pattern,
        max_shard_size=parse_size(max_shard_size),
    )
    files = [
        FilePlan(fname, [by_name[n] for n in names], dict(SAVE_PRETRAINED_METADATA), group=group)
        for fname, names in split.filename_to_tensors.items()
    ]
    index = None
    if split.is_sharded:
        counts = {} if total_parameters is None else {"total_parameters": total_parameters}
        index = {
            "metadata": {**counts, **split.metadata},  # total_size: each storage once, as the splitter counts it
            "weight_map": dict(sorted(split.tensor_to_filename.items())),
        }
    return ShardPlan(files, index)
