"""Messages of dependencies that tell a hf-merge user nothing, filtered where hf-merge runs them,
and the Hub request bitsandbytes makes at import, avoided.

- bitsandbytes 0.50, on AVX512-BF16 CPUs, asks the optional ``kernels`` package at import for a CPU
  kernel from the Hub (``get_kernel("kernels-community/...")``: a request to ``HF_ENDPOINT``, then a
  download). hf-merge is offline except for push, so :func:`no_hub_kernels` hides ``kernels`` while
  it imports bitsandbytes (or peft, which imports it); bitsandbytes then warns that it could not
  load that kernel ("Failed to load CPU gemm_4bit_forward from kernels-community") and falls back
  to its own, so nothing is wrong and the warning is dropped.
- ``MatMul8bitLt: inputs will be cast from ... to float16`` is logged by every int8 linear layer on
  every forward pass (84 lines for one generation of a small model): shown once.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"
_MATMUL_LOGGER = "bitsandbytes.autograd._functions"


class _DropContaining(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


class _OncePerPrefix(logging.Filter):
    """Lets the first message starting with ``prefix`` through, drops its repeats."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.seen = prefix, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefix):
            return True
        seen, self.seen = self.seen, True
        return not seen


def quiet_bitsandbytes() -> None:
    """Install the filters above (once per process; cheap, imports nothing)."""
    for name, make in ((_KERNEL_LOGGER, lambda: _DropContaining("kernels-community")),
                       (_MATMUL_LOGGER, lambda: _OncePerPrefix("MatMul8bitLt: inputs will be cast"))):
        log = logging.getLogger(name)
        if not any(isinstance(f, (_DropContaining, _OncePerPrefix)) for f in log.filters):
            log.addFilter(make())


@contextlib.contextmanager
def no_hub_kernels() -> Iterator[None]:
    """Within: ``import kernels`` fails (``sys.modules["kernels"] = None``), so importing
    bitsandbytes or peft makes no Hub request. Put back after; only bitsandbytes' first import asks.

    No switch of ``kernels`` does this: it honours ``HF_HUB_OFFLINE`` only as read when
    huggingface_hub was imported (and then loads a cached kernel), and offline is not global here
    (push needs the Hub).
    """
    saved = sys.modules.get("kernels", _ABSENT)
    sys.modules["kernels"] = None  # type: ignore[assignment]
    log = logging.getLogger(_KERNEL_LOGGER)
    drop = _DropContaining("kernels-community")
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)
        if saved is _ABSENT:
            if sys.modules.get("kernels", _ABSENT) is None:
                del sys.modules["kernels"]
        else:
            sys.modules["kernels"] = saved


_ABSENT = object()
