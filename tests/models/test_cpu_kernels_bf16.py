"""The serving path of bfloat16 on CPUs (C kernels + oneDNN-packed weights) against the plain
torch backend on the real default model, and weight packing against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.kernels.layer_ops import layer_ops_available
from iterserve.kernels.packed_linear import weight_packing_available
from iterserve.kernels.platform import CpuKernelsPlatform, TorchPlatform
from iterserve.models.layers import ColumnParallelLinear, RowParallelLinear

CPU = torch.device("cpu")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "List three colors:",
]


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_packed_linear_is_bit_exact(num_tokens: int) -> None:
    assert weight_packing_available(CPU, torch.bfloat16), "torch's CPU build has oneDNN"
    gen = torch.Generator().manual_seed(num_tokens)
    for layer in (ColumnParallelLinear(576, 960, bias=True), RowParallelLinear(1536, 576)):
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        layer = layer.to(torch.bfloat16)
        x = torch.randn(num_tokens, layer.weight.shape[1], generator=gen).bfloat16()
        expected = F.linear(x, layer.weight, layer.bias)
        layer.pack_weight(TorchPlatform())  # plain torch keeps the plain weight
        assert layer.packed is None and torch.equal(layer(x), expected)
        layer.pack_weight(CpuKernelsPlatform(pack_weights=True))
        assert layer.weight.numel() == 0  # the plain copy is freed
        assert torch.equal(layer(x), expected)
    assert not weight_packing_available(CPU, torch.float32)


# Where two backends' greedy paths part, the token each chose must be a near-tie in the
# other's distribution (natural log): bfloat16 roundings differ between the C layer ops and
# torch's fused RMSNorm, and between oneDNN's AVX-512 and AMX matmuls on different CPUs.
NEAR_TIE = 0.25


@pytest.mark.model
def test_bf16_greedy_matches_the_torch_backend() -> None:
    """The first 8 greedy tokens as plain torch's, up to a near-tie: where the two paths part
    (if they do), both tokens are within :data:`NEAR_TIE` of each other in each backend's own
    distribution; most prompts do not part at all."""
    from iterserve import LLM, SamplingParams

    assert layer_ops_available(CPU, torch.bfloat16), "the C kernels must build here"
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    outputs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(model="default", dtype="bfloat16", attention_backend=backend, num_kv_blocks=64)
        runner = llm.loaded.runner
        if backend == "cpu":  # the kernels and the packed weights are really in use
            assert runner.platform == CpuKernelsPlatform(pack_weights=True)
            assert runner.model.packed_lm_head is not None
            assert runner.model.layers[0].qkv_proj.packed is not None
        else:
            assert runner.platform == TorchPlatform() and runner.model.packed_lm_head is None
        outputs[backend] = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    identical = 0
    for cpu, ref in zip(outputs["cpu"], outputs["torch"], strict=True):
        if cpu.token_ids == ref.token_ids:
            identical += 1
            continue
        i = next(
            i for i, (a, b) in enumerate(zip(cpu.token_ids, ref.token_ids, strict=True)) if a != b
        )
        for mine, other in ((cpu, ref), (ref, cpu)):
            top = dict(mine.logprobs[i].top)  # type: ignore[index]
            other_token = other.token_ids[i]
            assert other_token in top, (i, mine.token_ids, other.token_ids)
            assert top[mine.token_ids[i]] - top[other_token] < NEAR_TIE, (i, top)
    assert identical >= len(PROMPTS) - 1, "only a near-tie may part the two paths"
