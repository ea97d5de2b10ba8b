"""LoRA views: the fused model (``W + scale * B @ A``) and the PEFT adapter, both lazy."""

from __future__ import annotations

import torch

from typing import Iterator

from ..checkpoint import ROW_CHUNK_BYTES, LazyCheckpoint, check_out
from ..readers.file_runs import values
from .lora_layout import PEFT_PREFIX, LoraLayout, LoraSettings
from ..spec import TensorSpec


#: rows of ``B @ A`` computed together, from row 0 on (see :func:`_delta_rows`)
_ROW_BLOCK = 64


def _delta_rows(b: torch.Tensor, a: torch.Tensor, start: int, stop: int, buf: torch.Tensor) -> torch.Tensor:
    """Rows ``start:stop`` of ``B @ A`` (a view of ``buf``), each rounded as one product over all of
    B's rows rounds it (PEFT's). BLAS kernels depend on how many rows a call has (a 1-row call is a
    matrix-vector product), so a run of rank-file rows (2 of a 4-row router on 2 ranks) is computed
    within whole blocks: rows ``[k * R, (k + 1) * R)`` for ``R =`` :data:`_ROW_BLOCK`, the last
    block running on to B's last row (``R`` to ``2R - 1`` rows). One call per run, as before, into
    ``buf`` (``stop - start + 3R`` rows: at most ``3R - 2`` more are computed than are used)."""
    total = b.shape[0]
    last = max(0, (total // _ROW_BLOCK - 1) * _ROW_BLOCK)  # where the last block starts
    lo = min(start - start % _ROW_BLOCK, last)
    end_block = min((stop - 1) - (stop - 1) % _ROW_BLOCK, last)
    hi = total if end_block == last else end_block + _ROW_BLOCK
    return torch.mm(b[lo:hi], a, out=buf[: hi - lo])[start - lo : stop - lo]

class FusedLora(LazyCheckpoint):
    """The model with every LoRA delta folded into its base weight.

    ``base`` serves HF-named base tensors (the checkpoint's own ``base_layer`` weights, or a
    ``--base-model`` folder for ``save_lora_only`` checkpoints); ``source`` serves the LoRA and
    modules_to_save tensors by their checkpoint keys. Each fused weight is computed alone in
    float32 as PEFT's ``merge_and_unload`` does (``W += (B @ A) * scale``), then written in the
    output buffer's dtype: one matmul and one weight-sized temporary in flight.
    """

    def __init__(self, base: LazyCheckpoint, source: LazyCheckpoint, layout: LoraLayout, settings: LoraSettings):
        self.base, self.source, self.layout, self.settings = base, source, layout, settings
        self.info = source.info
        base_specs = base.specs()
        self._fused = {m.weight: m for m in layout.modules.values()}
        missing = sorted(n for n in self._fused if n not in base_specs)
        if missing:
            from ..errors import LoraError

            raise LoraError(f"the base weights lack {missing[0]} (and {len(missing) - 1} more) that LoRA adapts; is --base-model the model that was trained?")
        src_specs = source.specs()
        self._specs = dict(base_specs)
        for name, key in layout.saved.items():
            self._specs[name] = src_specs[key].renamed(name)
        if any(m.experts for m in layout.modules.values()):  # one expert at a time, for the Hub layout's splits
            self.read_region_into = self._read_region_into

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read_into(self, name: str, out: torch.Tensor) -> None:
        check_out(self._specs[name], out)
        module = self._fused.get(name)
        if module is None:
            if name in self.layout.saved:
                self.source.read_into(self.layout.saved[name], out)
            else:
                self.base.read_into(name, out)
            return
        for first, rows in self.read_rows(name, out.dtype, ROW_CHUNK_BYTES):
            out[first : first + len(rows)].copy_(rows)

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        module = self._fused.get(name)
        if module is None:
            if name in self.layout.saved:
                return self.source.read_rows(self.layout.saved[name], dtype, max_bytes)
            return self.base.read_rows(name, dtype, max_bytes)
        if module.experts:
            return self._expert_rows(name, module, dtype, 0, module.experts)
        return self._fused_rows(name, module, dtype, max_bytes)

    def _read_region_into(self, name: str, start, out: torch.Tensor) -> None:
        """The box of ``name`` at ``start`` of ``out``'s shape; LoRA'd experts computed one
        whole expert at a time (so every element is what a full read gives), the rest read whole."""
        module = self._fused.get(name)
        box = tuple(slice(s, s + n) for s, n in zip(start[1:], out.shape[1:]))
        lo, hi = start[0], start[0] + out.shape[0]
        if module is not None and module.experts:
            runs = self._expert_rows(name, module, out.dtype, lo, hi)
        elif hasattr(self.base, "read_region_into") and module is None and name not in self.layout.saved:
            self.base.read_region_into(name, start, out)
            return
        else:
            runs = self.read_rows(name, self._specs[name].dtype) or iter([(0, self.read(name))])
        for first, piece in runs:  # the rows lo..hi of the runs, cut to the box
            rows = values(piece)
            a, b = max(lo, first), min(hi, first + len(rows))
            if a < b:
                out[a - lo : b - lo].copy_(rows[a - first : b - first][(slice(None),) + box])
            if first + len(rows) >= hi:
                break

    def _expert_rows(self, name: str, module, dtype: torch.dtype, lo: int, hi: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Experts ``lo..hi`` of ``W[e] + (B_e @ A_e) * scale``, one expert per run, in float32
        converted to ``dtype`` (``B_e = lora_B[:, e::E]``, ``A_e = lora_A[e*r:(e+1)*r]``, PEFT's
        layout; transposed experts ``[E, in, out]`` get the delta transposed). W is read as runs in
        its stored dtype (zero-copy views of a rank file: skipping experts before ``lo`` is free)."""
        a = self.source.read(module.a_key, dtype=torch.float32).view(module.experts, module.r, module.in_features)
        b = self.source.read(module.b_key, dtype=torch.float32).view(module.out_features, module.r, module.experts)
        scale = self.settings.scale(module)
        shape = self._specs[name].shape
        acc = torch.empty(shape[1:], dtype=torch.float32)
        low = acc if dtype == torch.float32 else torch.empty(shape[1:], dtype=dtype)
        for e, w in self._expert_weights(name, lo, hi):
            delta = torch.mm(b[:, :, e], a[e])  # [out, in], as PEFT's einsum over one expert
            # PEFT's W + delta * scale: scaled in float32, W added (upcast exactly), rounded once to dtype
            acc.copy_(delta.t() if module.transposed else delta).mul_(scale).add_(w)
            if low is not acc:
                low.copy_(acc)
            yield e, low.view((1,) + shape[1:])

    def _expert_weights(self, name: str, lo: int, hi: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(e, W[e])`` for ``lo <= e < hi``, in the stored floating dtype (float32 otherwise)."""
        spec = self.base.specs()[name]
        w_dtype = spec.dtype if spec.dtype.is_floating_point and spec.dtype.itemsize <= 4 else torch.float32
        runs = self.base.read_rows(name, w_dtype, ROW_CHUNK_BYTES)
        if runs is None:
            region = getattr(self.base, "read_region_into", None)
            if region is None:
                runs = iter([(0, self.base.read(name, dtype=w_dtype))])
            else:
                buf = torch.empty((1,) + spec.shape[1:], dtype=w_dtype)
                runs = ((e, region(name, (e, 0, 0), buf) or buf) for e in range(lo, hi))
        for first, piece in runs:
            rows = values(piece)
            for e in range(max(lo, first), min(hi, first + len(rows))):
                yield e, rows[e - first]
            if first + len(rows) >= hi:
                return

    def _fused_rows(self, name: str, module, dtype: torch.dtype, max_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``W + (B @ A) * scale`` a run of rows at a time, in float32, converted to ``dtype``.

        Row ``i`` of the result needs only row ``i`` of W and of B, so memory is a run of rows
        plus A and B (rank-r, small), whatever the size of W.
        """
        a = self.source.read(module.a_key, dtype=torch.float32)
        b = self.source.read(module.b_key, dtype=torch.float32)
        scale = self.settings.scale(module)
        step = max(1, max_bytes // (module.in_features * 4))
        # W in its stored dtype (zero-copy runs when it can): add_ upcasts it to float32 exactly, so
        # this equals converting W to float32 first, without that extra pass over W.
        w_dtype = self.base.specs()[name].dtype
        if not w_dtype.is_floating_point or w_dtype.itemsize > 4:
            w_dtype = torch.float32
        runs = self.base.read_rows(name, w_dtype, max_bytes)
        if runs is None:
            runs = iter([(0, self.base.read(name, dtype=w_dtype))])
        # Reused buffers (a run is valid until the next is requested): fresh ~32 MB allocations per
        # run would cost a page fault and a zeroed page per 4 KB.
        rows_out = min(step, module.out_features)
        delta = torch.empty(min(rows_out + 3 * _ROW_BLOCK, module.out_features), module.in_features, dtype=torch.float32)
        low = None if dtype == torch.float32 else torch.empty(rows_out, module.in_features, dtype=dtype)
        for first, piece in runs:
            weight = values(piece)
            for start in range(0, len(weight), step):
                rows = slice(first + start, first + min(start + step, len(weight)))
                n = rows.stop - rows.start
                # PEFT's W + (B @ A) * scale, the same three roundings: the delta is scaled and W
                # added in place (IEEE addition commutes exactly), then rounded once to ``dtype``.
                fused = _delta_rows(b, a, rows.start, rows.stop, delta).mul_(scale).add_(weight[start : start + step])
                if low is not None:
                    fused = low[:n].copy_(fused)
                yield rows.start, fused

    def close(self) -> None:
        self.base.close()
        self.source.close()


class LoraAdapter(LazyCheckpoint):
    """The adapter alone, under PEFT's saved names (``base_model.model.<m>.lora_A.weight``)."""

    def __init__(self, source: LazyCheckpoint, layout: LoraLayout):
        self.source = source
        self.info = source.info
        src = source.specs()
        self._table: dict[str, str] = {}
        for m in layout.modules.values():
            self._table[f"{PEFT_PREFIX}{m.name}.lora_A.weight"] = m.a_key
            self._table[f"{PEFT_PREFIX}{m.name}.lora_B.weight"] = m.b_key
        for name, key in layout.saved.items():
            self._table[f"{PEFT_PREFIX}{name}"] = key
        self._specs = {new: src[old].renamed(new) for new, old in self._table.items()}

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read_into(self, name: str, out: torch.Tensor) -> None:
        self.source.read_into(self._table[name], out)

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        return self.source.read_rows(self._table[name], dtype, max_bytes)
