"""The Triton KV write skips negative slots (padding rows of a CUDA-graph decode batch)."""

from __future__ import annotations

import torch

from iterserve.kernels.triton_checks import check_write_kv_padding


def test_negative_slots_are_skipped(device: torch.device) -> None:
    check_write_kv_padding(device)  # shared with `python -m benchmarks.gpu` section 1
