"""Device and CPU-library settings: the serving dtypes, the device each rank runs on, and the
oneDNN cache bounds set before the first matmul."""

from __future__ import annotations

import os

import torch

from iterserve.models.parallel import TPGroup

DTYPES = {
    "auto": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


# Entries of oneDNN's primitive cache and of ideep's operator cache (both 1,024 by default).
ONEDNN_CACHE_CAPACITY = 16


def bound_onednn_caches() -> dict[str, str]:
    """Cap the CPU matmul caches unless the environment already sets them; returns the values
    in force (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``).

    oneDNN (behind ``F.linear``, the packed linears and ``bmm`` on CPUs) caches one primitive
    per matmul shape, and ideep one operator per shape, up to 1,024 entries each. Every new
    number of tokens in an iteration is a new shape, so a server's RSS grew for its first
    quarter hour under mixed traffic (+524 MiB in the 30-minute soak) until both caches were
    full. With 16 entries the engine's malloc'd memory stays flat and iterations are as fast
    (measured: docs/reliability.md, "The real model, 30 minutes"). Both are read at the first
    matmul, so this runs before the model is built.
    """
    values = {}
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        values[name] = os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))
    return values


def select_device() -> torch.device:
    """The one place that decides the device: CUDA when present, else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def rank_device(tp: TPGroup) -> torch.device:
    """The device of rank ``tp.rank`` of a tensor-parallel group: its own GPU, or the CPU."""
    return torch.device("cuda", tp.rank) if torch.cuda.is_available() else torch.device("cpu")
