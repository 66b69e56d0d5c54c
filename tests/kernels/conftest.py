"""The C kernels must build on every machine the tests run on (the README asks for a C
compiler); without one this fixture fails the tests instead of skipping them."""

from __future__ import annotations

import pytest
import torch

from iterserve.kernels.layer_ops import layer_ops_available
from iterserve.kernels.paged_decode_attention import cpu_kernel_available


@pytest.fixture(scope="session")
def cpu_kernels() -> None:
    cpu = torch.device("cpu")
    assert cpu_kernel_available(torch.float32) and layer_ops_available(cpu, torch.bfloat16), (
        "the C kernels did not build: is there a C compiler (cc)?"
    )
