"""Choosing the platform once for ``--attention-backend``, device and dtype, and the two
platforms' ops agreeing on random inputs (each kernel is tested against its reference in
its own module; this checks what each platform wires to)."""

from __future__ import annotations

import pytest
import torch

from iterserve.config import ConfigError, EngineConfig
from iterserve.executor.build import build
from iterserve.kernels.platform import (
    CpuKernelsPlatform,
    Platform,
    TorchPlatform,
    TritonPlatform,
    select_platform,
)

pytestmark = pytest.mark.usefixtures("cpu_kernels")

CPU = torch.device("cpu")


def test_select_platform() -> None:
    assert select_platform("torch", CPU, torch.bfloat16) == TorchPlatform()
    # The C kernels where they build on a CPU; bfloat16 packs the linear weights too.
    assert select_platform("auto", CPU, torch.bfloat16) == CpuKernelsPlatform(pack_weights=True)
    assert select_platform("cpu", CPU, torch.float32) == CpuKernelsPlatform(pack_weights=False)
    # float16 has no kernel, nor has a GPU: auto falls back to torch, an explicit 'cpu' is
    # refused.
    assert select_platform("auto", CPU, torch.float16) == TorchPlatform()
    with pytest.raises(ValueError, match="'cpu' needs"):
        select_platform("cpu", CPU, torch.float16)
    with pytest.raises(ValueError, match="'cpu' needs"):
        select_platform("cpu", torch.device("cuda"), torch.float32)


def test_select_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA, auto is Triton (installed here); on a CPU, Triton runs only in its interpreter.
    cuda = torch.device("cuda")
    assert select_platform("auto", cuda, torch.bfloat16) == TritonPlatform()
    assert select_platform("triton", cuda, torch.float16) == TritonPlatform()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_platform("triton", CPU, torch.float32) == TritonPlatform()
    assert select_platform("auto", CPU, torch.float32) == CpuKernelsPlatform(pack_weights=False)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_platform("triton", CPU, torch.float32)
    # At start it is a setting's error (the CLI prints it and exits 2), before any weights load.
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        build(EngineConfig.from_kwargs(attention_backend="triton", num_kv_blocks=8))


TORCH, KERNELS, TRITON = TorchPlatform(), CpuKernelsPlatform(pack_weights=True), TritonPlatform()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_layer_ops_agree() -> None:
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    weight = torch.rand(64, generator=gen) + 0.5
    close(KERNELS.rms_norm(x, weight, 1e-5), TORCH.rms_norm(x, weight, 1e-5))
    out, res = KERNELS.rms_norm_residual(x, residual.clone(), weight, 1e-5)
    ref_out, ref_res = TORCH.rms_norm_residual(x, residual, weight, 1e-5)
    close(out, ref_out)
    close(res, ref_res)
    gate_up = torch.randn(5, 2 * 48, generator=gen)
    close(KERNELS.silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up))
    positions = torch.tensor([0, 3, 7, 1, 15])
    cos, sin = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
    q, k = torch.randn(5, 6, 32, generator=gen), torch.randn(5, 2, 32, generator=gen)
    ref_q, ref_k = TORCH.rotary(positions, cos, sin)(q, k)
    out_q, out_k = KERNELS.rotary(positions, cos, sin)(q.clone(), k.clone())
    close(out_q, ref_q)
    close(out_k, ref_k)
    logits = torch.randn(4, 1000, generator=gen).bfloat16()
    assert KERNELS.argmax_rows(logits).tolist() == TORCH.argmax_rows(logits).tolist()


@pytest.mark.parametrize("platform", [TORCH, KERNELS, TRITON], ids=["torch", "cpu", "triton"])
def test_write_kv_and_decode_attention(platform: Platform) -> None:
    """Keys written to their slots are what decode attention reads: against a dense softmax
    (Triton under its interpreter, set by tests/conftest.py)."""
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, num_blocks, block_size, head_dim = 2, 6, 16, 16
    key_cache = torch.zeros(num_kv_heads, num_blocks, block_size, head_dim)
    value_cache = torch.zeros_like(key_cache)
    block_table, seq_len = [4, 1], 19  # one sequence, its 19 tokens in blocks 4 then 1
    slots = torch.tensor(
        [block_table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
    )
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    platform.write_kv(k, v, key_cache, value_cache, slots)
    assert torch.equal(key_cache[:, 1, 2], k[18]) and torch.equal(value_cache[:, 4, 0], v[0])
    attend = platform.decode_attention(
        torch.tensor([block_table]),
        torch.tensor([seq_len]),
        [seq_len],
        num_blocks,
        block_size,
        0.25,
    )
    q = torch.randn(1, 4, head_dim, generator=gen)  # 4 query heads, 2 per KV head
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # [7, 4, D]
    probs = (torch.einsum("hd,thd->ht", q[0], kk) * 0.25).softmax(-1)
    close(attend(q, key_cache, value_cache)[0], torch.einsum("ht,thd->hd", probs, vv))


def test_weight_packing_is_the_platforms_choice() -> None:
    weight = torch.randn(96, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    assert TORCH.pack_linear_weight(weight) is None
    assert CpuKernelsPlatform(pack_weights=False).pack_linear_weight(weight) is None
    packed = KERNELS.pack_linear_weight(weight)
    assert packed is not None
    assert torch.equal(packed(x, None), torch.nn.functional.linear(x, weight))
