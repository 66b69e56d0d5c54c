"""The model runner on one platform: the model, the attention and the sampler all run the
ops of the platform the model was built with, on a tiny random Llama (exact op counts) and
on the real default model (the platform ``build`` chose)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from iterserve.engine.outputs import ScheduledRequest, SchedulerOutput
from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.attention import KVCache
from iterserve.executor.model_runner import TorchModelRunner
from iterserve.kernels.platform import (
    CpuKernelsPlatform,
    DecodeAttention,
    LinearOp,
    Rotate,
    TorchPlatform,
)
from iterserve.models.layers import RMSNorm
from iterserve.models.llama import LlamaForCausalLM

NUM_LAYERS, BLOCK_SIZE = 2, 4


@dataclass(frozen=True)
class CountingPlatform(TorchPlatform):
    """Plain torch that counts the calls of each op made on this very object."""

    calls: Counter[str] = field(default_factory=Counter, compare=False)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls["rms_norm"] += 1
        return super().rms_norm(x, weight, eps)

    def rms_norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls["rms_norm_residual"] += 1
        return super().rms_norm_residual(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        self.calls["silu_and_mul"] += 1
        return super().silu_and_mul(gate_up)

    def rotary(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Rotate:
        self.calls["rotary"] += 1
        return super().rotary(positions, cos, sin)

    def write_kv(self, *args: torch.Tensor) -> None:
        self.calls["write_kv"] += 1
        super().write_kv(*args)

    def decode_attention(self, *args: Any) -> DecodeAttention:
        self.calls["decode_attention"] += 1
        attend = super().decode_attention(*args)

        def counted(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
            self.calls["decode_attention call"] += 1
            return attend(q, kc, vc)

        return counted

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls["argmax_rows"] += 1
        return super().argmax_rows(logits)

    def pack_linear_weight(self, weight: torch.Tensor) -> LinearOp | None:
        self.calls["pack_linear_weight"] += 1
        return super().pack_linear_weight(weight)


def tiny_model(platform: TorchPlatform) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config, 64, platform)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.pack_linear_weights()
    return model.eval()


def step(*scheduled: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(scheduled=list(scheduled))


def test_every_op_runs_on_the_platform_the_model_was_built_with() -> None:
    platform = CountingPlatform()
    model = tiny_model(platform)
    assert platform.calls == {"pack_linear_weight": 1}  # asked once, keeps plain weights
    kv = KVCache(NUM_LAYERS, 8, BLOCK_SIZE, 2, 8, torch.float32, torch.device("cpu"))
    runner = TorchModelRunner(model, kv, seed=0)
    assert runner.platform is platform and runner.sampler.platform is platform
    assert all(m.platform is platform for m in model.modules() if isinstance(m, RMSNorm))
    greedy = SamplingParams(temperature=0.0)
    a = ScheduledRequest("a", [1, 2, 3, 4, 5], 0, [3, 0], True, greedy)
    out = runner.execute_model(step(a))
    first = out.sampled_token_ids["a"]
    platform.calls.clear()
    # One decode (a's 6th token) next to a prefill (b): both attention paths in one iteration.
    decode = ScheduledRequest("a", [first], 5, [3, 0], True, greedy)
    b = ScheduledRequest("b", [7, 8, 9], 0, [5], True, greedy)
    out = runner.execute_model(step(decode, b))
    assert set(out.sampled_token_ids) == {"a", "b"}
    assert platform.calls == {
        "rotary": 1,  # tables once per forward
        # Every norm but the first layer's input norm adds the residual first (plain torch's
        # residual norm then calls its rms_norm).
        "rms_norm_residual": 2 * NUM_LAYERS,
        "rms_norm": 1 + 2 * NUM_LAYERS,
        "silu_and_mul": NUM_LAYERS,
        "write_kv": NUM_LAYERS,
        "decode_attention": 1,  # prepared once per iteration
        "decode_attention call": NUM_LAYERS,
        "argmax_rows": 1,
    }


def test_both_platforms_agree_on_the_tiny_model() -> None:
    """The same greedy tokens from the same weights on plain torch and on the C kernels."""
    tokens = {}
    for platform in (TorchPlatform(), CpuKernelsPlatform(pack_weights=False)):
        kv = KVCache(NUM_LAYERS, 8, BLOCK_SIZE, 2, 8, torch.float32, torch.device("cpu"))
        runner = TorchModelRunner(tiny_model(platform), kv, seed=0)
        greedy, table = SamplingParams(temperature=0.0), [3, 0, 6]
        ids = [1, 2, 3, 4, 5]
        sched = ScheduledRequest("a", ids, 0, table, True, greedy)
        for _ in range(6):  # a prefill, then decodes
            token = runner.execute_model(step(sched)).sampled_token_ids["a"]
            sched = ScheduledRequest("a", [token], len(ids), table, True, greedy)
            ids = [*ids, token]
        tokens[platform.name] = ids
    assert tokens["cpu"] == tokens["torch"]


@pytest.mark.model
def test_build_chooses_one_platform_for_model_attention_and_sampler(loaded_f32: Any) -> None:
    runner = loaded_f32.runner
    # auto on this CPU: the C kernels (float32: plain weights, packing is bfloat16's).
    assert loaded_f32.platform == CpuKernelsPlatform(pack_weights=False)
    assert runner.platform is loaded_f32.platform
    assert runner.model.platform is runner.platform is runner.sampler.platform
    assert all(
        m.platform is runner.platform for m in runner.model.modules() if isinstance(m, RMSNorm)
    )
