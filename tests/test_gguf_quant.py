"""Q8_0 on the GGUF encoder threads: one intra-op torch thread there and larger groups, to the
same bytes, and the rest of the process keeps its torch threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF output needs pip install 'hf-merge[gguf]'")

from hf_merge.gguf import quant  # noqa: E402
from hf_merge.gguf.pipeline import prefetched  # noqa: E402


def _rows() -> torch.Tensor:
    """bf16 rows spanning several groups of either size, with all-zero blocks and exact ties."""
    torch.manual_seed(0)
    rows = (torch.randn(48, 4096) * 0.02).to(torch.bfloat16)
    rows[3, :64] = 0
    rows[5, :32] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5] + [0.0] * 27, dtype=torch.bfloat16)
    return rows


def test_q8_0_one_thread_groups_equal_the_reference():
    """``_q8_0`` on a thread set up by ``one_torch_thread`` (the larger groups) gives the bytes of
    gguf's reference quantizer, as it does on the main thread."""
    rows = _rows()
    reference = gguf.quants.quantize(rows.to(torch.float32).numpy(), gguf.GGMLQuantizationType.Q8_0)
    result = {}

    def encode() -> None:
        quant.one_torch_thread()
        result["threads"] = torch.get_num_threads()
        result["bytes"] = quant.encode(rows, "Q8_0")

    main_threads = torch.get_num_threads()
    worker = threading.Thread(target=encode)
    worker.start()
    worker.join()
    assert np.array_equal(result["bytes"].reshape(reference.shape), reference)
    assert np.array_equal(quant.encode(rows, "Q8_0").reshape(reference.shape), reference)
    assert torch.get_num_threads() == main_threads
    if quant._OPENMP:
        assert result["threads"] == 1


def test_prefetched_one_thread_leaves_the_callers_threads():
    main_threads = torch.get_num_threads()
    seen = list(prefetched((torch.get_num_threads() for _ in range(3)), one_thread=True))
    assert torch.get_num_threads() == main_threads
    assert len(seen) == 3 and (not quant._OPENMP or seen == [1, 1, 1])
