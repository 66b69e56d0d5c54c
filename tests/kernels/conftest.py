"""The C kernels must build on every machine the tests run on (the README asks for a C
compiler); without one this fixture fails the tests instead of skipping them. The Triton
kernels' tests run under Triton's interpreter (``TRITON_INTERPRET=1``, set here) without a GPU."""

from __future__ import annotations

import os

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


def _use_triton_interpreter() -> None:
    # The Triton kernels' tests run under Triton's interpreter where no GPU is present; it is
    # read when ``@triton.jit`` decorates, so before any kernel module is imported.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_use_triton_interpreter()
