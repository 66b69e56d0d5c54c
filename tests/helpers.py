"""Helpers shared by tests (importable as ``helpers`` thanks to pytest's pythonpath)."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from iterserve.config import EngineConfig
from iterserve.engine.factory import build_engine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.policy import PreemptionCosts

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
    info = dataclasses.replace(loaded.info, num_kv_blocks=num_kv_blocks, model_dir=None)
    costs = _preemption_costs(loaded)
    return build_engine(config, loaded.runner, loaded.tokenizer, info, preemption_costs=costs)


# Measured once per shared runner (as start-up would), not once per engine built on it.
_COSTS: weakref.WeakKeyDictionary[Any, PreemptionCosts] = weakref.WeakKeyDictionary()


def _preemption_costs(loaded: Any) -> PreemptionCosts | None:
    if not loaded.num_host_blocks or loaded.config.scheduler.preemption_mode != "auto":
        return None
    if loaded.runner not in _COSTS:
        _COSTS[loaded.runner] = loaded.runner.measure_preemption_costs()
    return _COSTS[loaded.runner]


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
