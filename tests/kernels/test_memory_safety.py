"""The C kernels under AddressSanitizer: every kernel over shapes with ragged tails (odd
lengths, partial chunks and blocks) in a subprocess whose kernels are built with
``-fsanitize=address``. An out-of-bounds read or write fails the test; at full speed such a
bug only corrupts the heap and aborts some later, unrelated free."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import torch
from iterserve.kernels import layer_ops as ops
from iterserve.kernels import quantized_linear as quant
from iterserve.kernels.kv_quant import quantize_kv_rows
from iterserve.kernels.paged_decode_attention import (
    paged_decode_attention_cpu, paged_decode_attention_reference)

gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    for heads, kv_heads, dim in ((9, 3, 64), (8, 2, 128), (16, 2, 64), (4, 2, 80)):
        for block_size in (1, 16, 32):
            lens = [1, 2, 15, 16, 17, 31, 33, 47, 100]
            width = max(-(-n // block_size) for n in lens)
            num_blocks = len(lens) * width
            shape = (kv_heads, num_blocks, block_size, dim)
            kc = torch.randn(shape, generator=gen).to(dtype)
            vc = torch.randn(shape, generator=gen).to(dtype)
            tables = torch.randperm(num_blocks, generator=gen).view(len(lens), width)
            seq_lens = torch.tensor(lens)
            q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
            for caches in ((kc, vc), (quantize_kv_rows(kc), quantize_kv_rows(vc))):
                out = torch.empty_like(q)
                paged_decode_attention_cpu(out, q, *caches, tables, seq_lens, 0.1)
                ref = paged_decode_attention_reference(q, *caches, tables, seq_lens, 0.1)
                torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    for num_tokens in (1, 3, 17):
        x = torch.randn(num_tokens, 576, generator=gen).to(dtype)
        residual = torch.randn(num_tokens, 576, generator=gen).to(dtype)
        ops.rms_norm_cpu(x, torch.ones(576, dtype=dtype), 1e-5, residual)
        ops.silu_and_mul_cpu(torch.randn(num_tokens, 2 * 1536, generator=gen).to(dtype))
        qkv = torch.randn(num_tokens, 15 * 64, generator=gen).to(dtype)
        q, k = qkv[:, :576].view(num_tokens, 9, 64), qkv[:, 576:768].view(num_tokens, 3, 64)
        cos = torch.randn(64, 64, generator=gen).to(dtype)
        ops.rotary_embedding_cpu(q, k, torch.arange(num_tokens) * 3, cos, cos)
        v = qkv[:, 768:].view(num_tokens, 3, 64)
        cache = torch.zeros(3, 4, 8, 64, dtype=dtype)
        ops.reshape_and_cache_cpu(k, v, cache, cache.clone(), torch.arange(num_tokens) * 2 - 1)
        rows = torch.zeros(3, 4, 8, 68, dtype=torch.int8)  # int8 rows and their scales
        ops.reshape_and_cache_cpu(k, v, rows, rows.clone(), torch.arange(num_tokens) * 2 - 1)
        ops.dequantize_kv_rows_cpu(rows[: num_tokens % 3 + 1], dtype)
        logits = torch.randn(num_tokens, 2, 1001, generator=gen).to(dtype)[:, 1]
        assert ops.argmax_rows_cpu(logits).tolist() == logits.argmax(-1).tolist()
for num_tokens in (1, 3, 40, 200):  # 200 x 576: past the fused norm's threading threshold
    x = torch.randn(num_tokens, 2, 576, generator=gen).to(torch.bfloat16)[:, 0]
    residual = torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16)
    smooth = torch.rand(576, generator=gen) + 0.5
    quant.rms_norm_quantize(x, torch.ones(576, dtype=torch.bfloat16), 1e-5, residual, smooth)
    rows = quant.quantize_rows_int8(x, smooth)
    acc = torch.randn(num_tokens, 2 * 1536, generator=gen)
    quant.silu_and_mul_quantize(acc, rows[1], torch.rand(1536, generator=gen) + 0.5)
    quant.dequantize_rows(acc, rows[1], torch.ones(3072, dtype=torch.bfloat16))
print("clean")
"""


def _libasan() -> str | None:
    try:
        path = subprocess.run(
            ["cc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def test_kernels_are_memory_safe_under_asan(tmp_path: Path) -> None:
    libasan = _libasan()
    assert libasan is not None, "no AddressSanitizer runtime: the C compiler comes with one"
    env = os.environ | {
        "ITERSERVE_KERNEL_CFLAGS": "-fsanitize=address -fno-omit-frame-pointer -g",
        "ITERSERVE_CACHE_DIR": str(tmp_path),
        "LD_PRELOAD": libasan,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
    }
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert "AddressSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr[-4000:]
    assert list((tmp_path / "kernels").glob("*.so")), "the sanitized kernels were not built"
