"""Environment variables read by iterserve (all prefixed ``ITERSERVE_``), typed, in one place."""

from __future__ import annotations

import os
from pathlib import Path

# Directory for converted models (default: the user cache dir, e.g. ~/.cache/iterserve).
ITERSERVE_CACHE_DIR: str | None = os.environ.get("ITERSERVE_CACHE_DIR") or None

# Secrets for the server, so that they need not appear on a command line (Kubernetes Secrets).
ITERSERVE_API_KEY: str | None = os.environ.get("ITERSERVE_API_KEY") or None
ITERSERVE_ADMIN_TOKEN: str | None = os.environ.get("ITERSERVE_ADMIN_TOKEN") or None
# The router: the key its clients send is ITERSERVE_API_KEY; the one the replicas expect:
ITERSERVE_BACKEND_API_KEY: str | None = os.environ.get("ITERSERVE_BACKEND_API_KEY") or None

# Extra C compiler flags for the CPU kernels (tests build them with AddressSanitizer this way).
ITERSERVE_KERNEL_CFLAGS: str = os.environ.get("ITERSERVE_KERNEL_CFLAGS", "")


def triton_interpret() -> bool:
    """Triton's own ``TRITON_INTERPRET=1`` (its kernels run in Python on the CPU), read when
    asked: the platform allows the ``triton`` backend on a CPU only under it."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def quantized_max_rows() -> int | None:
    """``ITERSERVE_QUANTIZED_MAX_ROWS``, read when asked: ``--quantization``'s kernel (int8
    or int4) for up to this many rows (tokens of an iteration), bfloat16 above; 0: bfloat16
    only. Fixed instead of measured at start (replicas that must compute alike, the quality
    benchmark). Unset: measured.

    Raises:
        ValueError: not a non-negative integer.
    """
    value = os.environ.get("ITERSERVE_QUANTIZED_MAX_ROWS", "").strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"ITERSERVE_QUANTIZED_MAX_ROWS must be an integer >= 0: {value!r}")
    return int(value)


def cache_dir() -> Path:
    """iterserve's cache directory: ``ITERSERVE_CACHE_DIR``, else the user cache dir (e.g.
    ``~/.cache/iterserve``). ``platformdirs`` is imported here, when a cache is used: the GPU
    check runs where it is not installed and uses none."""
    if ITERSERVE_CACHE_DIR:
        return Path(ITERSERVE_CACHE_DIR)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("iterserve"))
