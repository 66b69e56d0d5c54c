"""transformers' own continuous batching on the prompts of ``python -m benchmarks.gpu`` section 3,
defensive about the transformers version (the lent machine's may be older than this one's)."""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

# Seconds to wait for transformers' generation thread after a hard stop.
_STOP_TIMEOUT_S = 30.0


def transformers_throughput(
    model: Any,
    prompts: list[list[int]],
    output_len: int,
    timeout_s: float,
    device: torch.device,
    max_batch_tokens: int = 8192,
) -> dict[str, Any]:
    """transformers' ``ContinuousBatchingManager`` (what ``generate_batch`` runs) on
    ``prompts``, ``output_len`` greedy tokens each, EOS never stopping them, a KV cache sized
    to the workload and ``max_batch_tokens`` per iteration (see :func:`_manager_kwargs`);
    stops it after ``timeout_s`` and counts the requests finished by then. Its warm-up (CUDA
    graphs) is not timed. Returns the counts, seconds, tokens per second and each request's token
    ids (empty for unfinished ones)."""
    import transformers
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    if not hasattr(model, "continuous_batching_context_manager"):
        return _generate_batch(model, prompts, config)
    manager_kwargs, cache = _manager_kwargs(model, device, prompts, output_len, max_batch_tokens)
    results: dict[str, list[int]] = {}
    early_stop = None  # after a timeout: "done", or "thread still running"
    # A time limit on the stop too: a generation thread that hangs must not hang the run.
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=_STOP_TIMEOUT_S, **manager_kwargs
    ) as cb:
        start = time.perf_counter()  # after the manager's warm-up (CUDA graphs)
        add_params = inspect.signature(cb.add_request).parameters
        ids = []
        for prompt in prompts:
            kwargs: dict[str, Any] = {"max_new_tokens": output_len}
            if "eos_token_id" in add_params:
                kwargs["eos_token_id"] = -1  # never stop early
            ids.append(cb.add_request(prompt, **kwargs))
        deadline = start + timeout_s
        while len(results) < len(ids) and time.perf_counter() < deadline:
            result = cb.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = list(result.generated_tokens)
            elif result is None and hasattr(cb, "is_running") and not cb.is_running():
                raise RuntimeError("transformers' continuous batching manager stopped")
        seconds = time.perf_counter() - start
        # What ran (the manager restores the model's own implementation when it stops).
        attn_implementation = getattr(model.config, "_attn_implementation", None)
        if len(results) < len(ids):
            ended = _stop_now(cb, [i for i in ids if i not in results])
            early_stop = "done" if ended else "thread still running"
    generated = sum(map(len, results.values()))
    return {
        "version": transformers.__version__,
        "api": "continuous_batching_context_manager",
        "attn_implementation": attn_implementation,
        "cache": cache,
        "generated_tokens": generated,
        "finished_requests": len(results),
        "timed_out": len(results) < len(ids),
        "early_stop": early_stop,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "token_ids": [results.get(i, []) for i in ids],
    }


def _stop_now(cb: Any, unfinished: list[str]) -> bool:
    """Stop the manager without finishing its requests; whether its thread has ended.

    Leaving the context manager stops it with ``FLUSH_AND_STOP`` (transformers 5.x): every
    pending request is generated to the end first, so ``timeout_s`` would bound nothing. A
    hard stop (``hard_stop=True``) fails them instead; a transformers without it has the
    unfinished requests cancelled.
    """
    if "hard_stop" in inspect.signature(cb.stop).parameters:
        cb.stop(block=True, timeout=_STOP_TIMEOUT_S, hard_stop=True)
    else:
        for request_id in unfinished:
            if hasattr(cb, "cancel_request"):
                cb.cancel_request(request_id)
        cb.stop(block=True, timeout=_STOP_TIMEOUT_S)
    return not (hasattr(cb, "is_running") and cb.is_running())


def _generate_batch(model: Any, prompts: list[list[int]], config: Any) -> dict[str, Any]:
    """A transformers without the context manager: ``generate_batch`` timed whole (its
    warm-up included), no time limit."""
    import transformers

    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config)
    seconds = time.perf_counter() - start
    # Request ids in submission order: req_0, req_1, ...
    token_ids = [list(o.generated_tokens) for _, o in sorted(
        outputs.items(), key=lambda kv: int(str(kv[0]).rpartition("_")[2] or 0)
    )]  # fmt: skip
    generated = sum(map(len, token_ids))
    return {
        "version": transformers.__version__,
        "api": "generate_batch",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "generated_tokens": generated,
        "finished_requests": len(token_ids),
        "timed_out": False,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "token_ids": token_ids,
    }


def _manager_kwargs(
    model: Any,
    device: torch.device,
    prompts: list[list[int]],
    output_len: int,
    max_batch_tokens: int,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The context manager's keywords, where this transformers takes them, and the cache
    they ask for.

    The KV cache is sized to the workload (every request's prompt and output, plus a tenth),
    as iterserve's pool is, with iterserve's tokens per iteration: left to itself transformers
    takes 80 % of the free memory, and its warm-up runs a forward that reads all of it (tens
    of seconds on an 8B model, outside any time limit). On a CPU (tests): no warm-up either,
    and blocks of 16 tokens.
    """
    params = inspect.signature(model.continuous_batching_context_manager).parameters
    kwargs: dict[str, Any] = {}
    if device.type != "cuda" and "warmup" in params:
        kwargs["warmup"] = False
    if "continuous_batching_config" not in params:
        return kwargs, None
    from transformers import ContinuousBatchingConfig

    # Tokens per cache block: page_size since 5.18 (block_size before, deprecated after).
    fields = inspect.signature(ContinuousBatchingConfig).parameters
    key = "page_size" if "page_size" in fields else "block_size"
    block: dict[str, Any] = {}
    if device.type != "cuda" and key in fields:
        block[key] = 16
    block_size = block.get(key) or getattr(ContinuousBatchingConfig(), key, None) or 256
    needed = sum(-(-(len(p) + output_len) // block_size) for p in prompts)
    num_blocks = needed + needed // 10 + 4
    kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
        num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, **block
    )
    cache = dict(num_blocks=num_blocks, block_size=block_size, max_batch_tokens=max_batch_tokens)
    return kwargs, cache
