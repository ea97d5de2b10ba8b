"""Messages of dependencies that tell a hf-merge user nothing, filtered where hf-merge runs them.

- bitsandbytes 0.50, on AVX512-BF16 CPUs without the optional ``kernels`` package, warns at import
  that it cannot download a CPU kernel ("Failed to load CPU gemm_4bit_forward from
  kernels-community"); it falls back to its own kernel, so nothing is wrong.
- ``MatMul8bitLt: inputs will be cast from ... to float16`` is logged by every int8 linear layer on
  every forward pass (84 lines for one generation of a small model): shown once.
"""

from __future__ import annotations

import logging

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
