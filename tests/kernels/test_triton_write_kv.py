"""The Triton KV-cache write against its torch reference (exact: it copies), under Triton's
interpreter without a GPU (tests/conftest.py sets ``TRITON_INTERPRET=1``); the check itself is
:func:`iterserve.kernels.triton_checks.check_write_kv`, which ``python -m benchmarks.gpu``
also runs."""

from __future__ import annotations

import pytest
import torch

from iterserve.kernels.triton_checks import WRITE_KV_DTYPES, check_write_kv
from iterserve.kernels.triton_write_kv import write_kv


@pytest.mark.parametrize("dtype", WRITE_KV_DTYPES)
def test_matches_reference(dtype: torch.dtype) -> None:
    check_write_kv(dtype)


def test_rejects_bad_inputs() -> None:
    key = torch.zeros(2, 1, 64)
    cache = torch.zeros(1, 2, 16, 64)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="one dtype"):
        write_kv(key, key, cache.half(), cache.half(), slots)
    with pytest.raises(ValueError, match="does not fit"):
        write_kv(torch.zeros(2, 2, 64), torch.zeros(2, 2, 64), cache, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        write_kv(key, key, cache, cache, slots.int())
