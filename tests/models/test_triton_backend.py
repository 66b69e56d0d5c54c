"""The Triton backend (under Triton's interpreter on the CPU, set by tests/conftest.py) against
the plain torch backend on the real default model: the same greedy tokens in float32."""

from __future__ import annotations

import pytest

from iterserve.kernels.platform import TorchPlatform, TritonPlatform

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.mark.model
def test_triton_greedy_matches_the_torch_backend() -> None:
    """Prefill (a whole prompt per request) and decode iterations both run the Triton kernels;
    few tokens, because the interpreter runs every kernel program in Python."""
    from iterserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0)
    outputs = {}
    for backend, platform in (("torch", TorchPlatform()), ("triton", TritonPlatform())):
        llm = LLM(model="default", dtype="float32", attention_backend=backend, num_kv_blocks=16)
        assert llm.loaded.runner.platform == platform
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert outputs["triton"] == outputs["torch"]
