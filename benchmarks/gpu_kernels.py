"""``python -m benchmarks.gpu`` sections 1 and 2: the Triton kernel checks on the device, and the
paged-attention decode kernel's achieved bandwidth against a device copy.

Bandwidth counts the bytes a decode must move at least: every context token's key and value
(all KV heads), the queries, the output and the block tables, over the kernel's time; the
copy's bandwidth counts read + write (``2 * bytes / time`` of a large ``copy_``), as
``python -m benchmarks.decode`` does.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def time_ms(fn: Callable[[], Any], device: torch.device, iters: int = 20) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` (CUDA events, L2 flushed
    between runs) on a GPU, wall-clock medians on a CPU."""
    if device.type == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(fn, warmup=5, rep=max(iters * 2, 20), return_mode="median")
        return float(ms)
    fn()  # warm-up (compiles)
    times = []
    for _ in range(max(iters, 1)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second of a ``num_bytes`` device-to-device ``copy_`` (read + write counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = time_ms(lambda: dst.copy_(src), device) / 1e3
    return 2 * num_bytes / seconds


def triton_preflight(device: torch.device) -> dict[str, Any]:
    """Compile and run one small Triton kernel (the KV write) on ``device``: whether Triton
    works there at all. On a GPU its first launch builds Triton's launcher with the C
    compiler (``CC``, else gcc or clang) against Python's headers; a machine without them
    fails here, in seconds, and says so."""
    import shutil
    import sysconfig
    from pathlib import Path

    from iterserve.kernels.triton_write_kv import write_kv

    include = sysconfig.get_paths().get("include", "")
    info: dict[str, Any] = {
        "c_compiler": os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang"),
        "python_h": (Path(include) / "Python.h").is_file(),
    }
    start = time.perf_counter()
    try:
        kv = torch.ones(1, 1, 16, device=device)
        cache = torch.zeros(1, 1, 16, 16, device=device)
        write_kv(kv, kv, cache, cache.clone(), torch.tensor([3], device=device))
        if float(cache[0, 0, 3].sum()) != 16.0:
            raise AssertionError("the KV write stored the wrong values")
        info |= {"ok": True}
    except Exception as e:  # reported, and the model sections fall back to plain torch
        info |= {"ok": False, "error": repr(e), "traceback": traceback.format_exc()}
    info["seconds"] = time.perf_counter() - start
    return info


def run_kernel_checks(device: torch.device) -> dict[str, Any]:
    """Every case of :mod:`iterserve.kernels.triton_checks` on ``device`` (bfloat16 too on a
    GPU). One failing case is recorded and the others still run.

    Raises:
        AssertionError: after all cases ran, naming the failed ones.
    """
    from iterserve.kernels.triton_checks import (
        ATTENTION_CASES,
        TOLERANCE,
        WRITE_KV_DTYPES,
        check_paged_attention,
        check_write_kv,
        check_write_kv_padding,
        gpu_attention_cases,
    )

    attention_cases = gpu_attention_cases() if device.type == "cuda" else ATTENTION_CASES
    checks: list[dict[str, Any]] = []
    for case in attention_cases:
        entry: dict[str, Any] = {"kernel": "paged_attention", "case": case.name}
        entry |= {"dtype": str(case.dtype).removeprefix("torch."), **TOLERANCE[case.dtype]}
        checks.append(_run_check(entry, functools.partial(check_paged_attention, case, device)))
    write_dtypes = (*WRITE_KV_DTYPES, torch.bfloat16) if device.type == "cuda" else WRITE_KV_DTYPES
    for dtype in write_dtypes:
        entry = {"kernel": "write_kv", "case": "strided-values", "dtype": str(dtype)[6:]}
        checks.append(_run_check(entry, functools.partial(check_write_kv, dtype, device)))
    entry = {"kernel": "write_kv", "case": "padding-slots", "dtype": "float32"}
    checks.append(_run_check(entry, functools.partial(check_write_kv_padding, device)))
    failed = [f"{c['kernel']}/{c['case']}/{c['dtype']}" for c in checks if not c["passed"]]
    result = {"num_checks": len(checks), "num_failed": len(failed), "checks": checks}
    if failed:
        raise SectionFailed(f"kernel checks failed: {', '.join(failed)}", result)
    return result


class SectionFailed(AssertionError):
    """A section that ran to the end but missed a check; carries its results."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


def _run_check(entry: dict[str, Any], check: Callable[[], float | None]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        max_error = check()
        entry |= {"passed": True, "max_abs_error": max_error}
    except Exception as e:  # a failed case is a result; the others still run
        entry |= {"passed": False, "error": repr(e), "traceback": traceback.format_exc()}
    entry["seconds"] = time.perf_counter() - start
    return entry


@dataclass(frozen=True)
class AttentionShape:
    """A pure-decode batch: ``batch`` requests of ``context`` tokens (the new one included)."""

    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


def time_decode_attention(shape: AttentionShape, device: torch.device) -> dict[str, Any]:
    """Time :func:`~iterserve.kernels.triton_paged_attention.paged_attention` on one decode
    batch whose blocks are scattered over a pool sized for this shape only (one layer)."""
    from iterserve.kernels.triton_paged_attention import default_num_splits, paged_attention

    s = shape
    blocks_per_seq = -(-s.context // s.block_size)
    num_blocks = s.batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    cache_shape = (s.num_kv_heads, num_blocks, s.block_size, s.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=s.dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=s.dtype)
    # [batch, blocks_per_seq]: every block once, in random order
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).view(s.batch, -1)
    seq_lens = torch.full((s.batch,), s.context, dtype=torch.int64, device=device)
    query_start_loc = torch.arange(s.batch + 1, dtype=torch.int64, device=device)
    q = torch.randn(s.batch, s.num_heads, s.head_dim, generator=gen, device=device, dtype=s.dtype)
    out = torch.empty_like(q)
    scale = s.head_dim**-0.5

    def run() -> None:
        paged_attention(
            q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 1, s.context,
            scale, out=out,
        )  # fmt: skip

    ms = time_ms(run, device)
    itemsize = q.element_size()
    kv_bytes = 2 * s.batch * s.context * s.num_kv_heads * s.head_dim * itemsize
    bytes_moved = kv_bytes + 2 * q.numel() * itemsize + block_tables.numel() * 8
    return {
        "batch": s.batch,
        "context": s.context,
        "num_splits": default_num_splits(s.batch, s.num_kv_heads, s.context),
        "ms": ms,
        "bytes": bytes_moved,
        "bandwidth_gb_s": bytes_moved / (ms / 1e3) / 1e9,
    }


def run_attention_timing(
    shapes: list[AttentionShape], device: torch.device, copy_bytes: int
) -> dict[str, Any]:
    """Achieved bandwidth of each decode shape and its ratio to the copy bandwidth; the
    target is >= 0.8 at batch 64, context 2,048 (recorded, not asserted)."""
    copy_bw = copy_bandwidth(device, copy_bytes)
    rows = []
    for shape in shapes:
        row = time_decode_attention(shape, device)
        row["vs_copy"] = row["bandwidth_gb_s"] * 1e9 / copy_bw
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    first = shapes[0]
    target = next((r for r in rows if (r["batch"], r["context"]) == (64, 2048)), None)
    return {
        "shape": {
            "num_heads": first.num_heads,
            "num_kv_heads": first.num_kv_heads,
            "head_dim": first.head_dim,
            "block_size": first.block_size,
            "dtype": str(first.dtype).removeprefix("torch."),
            "block_tables": "scattered (a random permutation of the pool)",
        },
        "copy_bytes": copy_bytes,
        "copy_bandwidth_gb_s": copy_bw / 1e9,
        "rows": rows,
        "target": ">= 0.8 of copy bandwidth at batch 64, context 2048",
        "target_ratio": None if target is None else target["vs_copy"],
        "target_met": None if target is None else target["vs_copy"] >= 0.8,
    }
