"""Linear layers on weights packed once for oneDNN (bfloat16 on CPUs).

``F.linear`` reorders a plain weight into oneDNN's blocked layout on every call: 1.1-2x slower
than a weight reordered once at start (what ``torch.compile``'s CPU freezing pass does) at
decode batch sizes. :class:`PackedLinear` holds the reordered weight and runs the matmul that
reads it; ``F.linear`` on the plain weight is its reference (bit-identical, see
tests/models/test_cpu_kernels_bf16.py).
"""

from __future__ import annotations

import torch

# Batch size oneDNN is told to expect when packing (measured on the development CPU: packed
# weights beat F.linear at every batch from 1 to 512, the hint changes little).
PACK_BATCH_HINT = 64


def weight_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`PackedLinear` works here: CPU, bfloat16, torch built with oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear:
    """``F.linear(x, weight, bias)`` on ``weight`` reordered once into oneDNN's layout.

    Args:
        weight: [out_features, in_features] bfloat16 CPU tensor (the plain weight can be freed
            afterwards: the packed copy is a separate tensor).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [num_tokens, in_features] in the weight's dtype -> [num_tokens, out_features]."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")
