"""LoRA views: the fused model (``W + scale * B @ A``) and the PEFT adapter, both lazy."""

from __future__ import annotations

import torch

from typing import Iterator

from ..checkpoint import ROW_CHUNK_BYTES, LazyCheckpoint, check_out
from ..lora import PEFT_PREFIX, LoraLayout, LoraSettings
from ..spec import TensorSpec


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
        self._fused = {f"{m.name}.weight": m for m in layout.modules.values()}
        missing = sorted(n for n in self._fused if n not in base_specs)
        if missing:
            from ..errors import LoraError

            raise LoraError(f"the base weights lack {missing[0]} (and {len(missing) - 1} more) that LoRA adapts; is --base-model the model that was trained?")
        src_specs = source.specs()
        self._specs = dict(base_specs)
        for name, key in layout.saved.items():
            self._specs[name] = src_specs[key].renamed(name)

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
        for first, rows in self._fused_rows(name, module, out.dtype, ROW_CHUNK_BYTES):
            out[first : first + len(rows)].copy_(rows)

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        module = self._fused.get(name)
        if module is None:
            if name in self.layout.saved:
                return self.source.read_rows(self.layout.saved[name], dtype, max_bytes)
            return self.base.read_rows(name, dtype, max_bytes)
        return self._fused_rows(name, module, dtype, max_bytes)

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
        acc = torch.empty(rows_out, module.in_features, dtype=torch.float32)
        low = acc if dtype == torch.float32 else torch.empty(rows_out, module.in_features, dtype=dtype)
        for first, weight in runs:
            for start in range(0, len(weight), step):
                rows = slice(first + start, first + min(start + step, len(weight)))
                n = rows.stop - rows.start
                # PEFT's W + (B @ A) * scale, the same three roundings: the delta is scaled and W
                # added in place (IEEE addition commutes exactly), then rounded once to ``dtype``.
                fused = torch.mm(b[rows], a, out=acc[:n]).mul_(scale).add_(weight[start : start + step])
                if low is not acc:
                    low[:n].copy_(fused)
                yield rows.start, low[:n]

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
