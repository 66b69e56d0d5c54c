"""transformers' own continuous batching on the prompts of ``iterserve bench gpu`` section 3,
defensive about the transformers version (the lent machine's may be older than this one's)."""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch


def transformers_throughput(
    model: Any,
    prompts: list[list[int]],
    output_len: int,
    timeout_s: float,
    device: torch.device,
) -> dict[str, Any]:
    """transformers' ``ContinuousBatchingManager`` (what ``generate_batch`` runs) on
    ``prompts``, ``output_len`` greedy tokens each, EOS never stopping them; stops waiting
    after ``timeout_s`` and counts the requests finished by then. Its warm-up (CUDA graphs)
    is not timed. Returns the counts, seconds, tokens per second and each request's token
    ids (empty for unfinished ones)."""
    import transformers
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    if not hasattr(model, "continuous_batching_context_manager"):
        return _generate_batch(model, prompts, config)
    manager_kwargs = _manager_kwargs(model, device)
    results: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, **manager_kwargs
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
    generated = sum(map(len, results.values()))
    return {
        "version": transformers.__version__,
        "api": "continuous_batching_context_manager",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "generated_tokens": generated,
        "finished_requests": len(results),
        "timed_out": len(results) < len(ids),
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "token_ids": [results.get(i, []) for i in ids],
    }


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


def _manager_kwargs(model: Any, device: torch.device) -> dict[str, Any]:
    """On a CPU (tests): no warm-up and a small cache, where this transformers takes them."""
    if device.type == "cuda":
        return {}
    params = inspect.signature(model.continuous_batching_context_manager).parameters
    kwargs: dict[str, Any] = {}
    if "warmup" in params:
        kwargs["warmup"] = False
    if "continuous_batching_config" in params:
        from transformers import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=64, max_batch_tokens=256, page_size=16
        )
    return kwargs
