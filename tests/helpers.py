"""Helpers shared by tests (importable as ``helpers`` thanks to pytest's pythonpath)."""

from __future__ import annotations

from typing import Any

from iterserve.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine

# Pool of the shared runner's KV cache; engines built on it may use fewer blocks.
SHARED_NUM_KV_BLOCKS = 384


def make_engine(loaded: Any, **kwargs: Any) -> LLMEngine:
    """A fresh engine (own scheduler and block manager) on the shared float32 model runner."""
    num_kv_blocks = kwargs.pop("num_kv_blocks", SHARED_NUM_KV_BLOCKS)
    assert num_kv_blocks <= loaded.num_kv_blocks
    kwargs.setdefault("max_model_len", loaded.config.model.max_model_len)
    config = EngineConfig.from_kwargs(dtype="float32", num_kv_blocks=num_kv_blocks, **kwargs)
    # The runner outlives engines here: forget the sampling state of earlier engines' requests.
    loaded.runner.states.clear()
    return LLMEngine(
        config,
        loaded.runner,
        loaded.tokenizer,
        num_kv_blocks=num_kv_blocks,
        vocab_size=int(loaded.hf_config.vocab_size),
        eos_token_ids=loaded.eos_token_ids,
        num_host_blocks=loaded.num_host_blocks,
        preemption_costs=loaded.preemption_costs,
    )


async def collect(
    client: Any, request_id: str, prompt_token_ids: list[int], params: Any, priority: int = 1
) -> tuple[list[Any], Any]:
    """Stream a request through an engine client: its deltas, and the cumulative output they
    add up to (an ``OutputAccumulator``'s)."""
    import time

    from iterserve.engine.messages import AddRequest
    from iterserve.engine.outputs import OutputAccumulator

    request = AddRequest(request_id, prompt_token_ids, params, priority, time.monotonic())
    accumulator = OutputAccumulator(
        request_id, None, prompt_token_ids, params.n, params.logprobs is not None
    )
    deltas = [delta async for delta in client.generate(request)]
    for delta in deltas:
        accumulator.add(delta)
    return deltas, accumulator.output
