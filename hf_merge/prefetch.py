"""Read a lazy checkpoint's tensors on background threads while the model is still being built.

``from_sharded_pretrained`` spends its first second or more importing the model's code and
building it on the meta device: Python work on one core. The weights' bytes (``preadv`` from the
rank files into fresh tensors: kernel work that releases the GIL) need not wait for that, so
:class:`Prefetch` starts reading them as soon as the view's specs are known; the fill then takes
each tensor ready-made. Each tensor is still allocated once, in the dtype the view yields, and
read with the same ``read_into`` as without prefetching (bit-identical). A tensor the model wants
in another dtype, shape or device is dropped and read again as before.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .checkpoint import LazyCheckpoint


class Prefetch:
    """``view``'s tensors ``names``, read in that order on ``threads`` background threads."""

    def __init__(self, view: LazyCheckpoint, names: list[str], threads: int):
        self._view = view
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hf-merge prefetch")
        self._futures: dict[str, Future] = {name: self._pool.submit(self._read, name) for name in names}

    def _read(self, name: str) -> torch.Tensor:
        spec = self._view.specs()[name]
        out = torch.empty(spec.shape, dtype=spec.dtype)
        self._view.read_into(name, out)
        return out

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: object) -> torch.Tensor | None:
        """The tensor read for ``name`` (waiting for it), or None when it was not read or does not
        fit ``shape``/``dtype``/``device`` (the caller reads it itself then). A read's error is raised."""
        future = self._futures.pop(name, None)
        if future is None:
            return None
        spec = self._view.specs()[name]
        if torch.device(device).type != "cpu" or spec.dtype != dtype or tuple(spec.shape) != tuple(shape):
            future.cancel()
            return None
        return future.result()

    def close(self) -> None:
        """Stop reading; tensors not taken are freed."""
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        self._futures.clear()
