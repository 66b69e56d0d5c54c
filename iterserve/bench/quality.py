"""What ``--quantization`` and ``--kv-cache-dtype int8`` cost in quality, measured on the real
model (``bench quantization``).

- Perplexity on a text the package ships (``data/declaration.txt``, public domain): the
  whole text as one sequence, prefilled in chunks through the paged KV cache, every token's
  log-probability from the model's own logits (float32 log-softmax).
- Greedy agreement with bfloat16 over a prompt set (the seeded ``mixed`` workload's prompts):
  the fraction of prompts whose whole greedy continuation is the same, and the mean share of
  each continuation generated before it first differs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from iterserve.engine.outputs import ScheduledRequest
from iterserve.engine.sampling_params import SamplingParams

PERPLEXITY_TEXT = "declaration.txt"
CHUNK_TOKENS = 256  # prefill chunk of the perplexity pass
BLOCK_SIZE = 16


def perplexity_text() -> str:
    """The shipped text the perplexity is measured on."""
    return resources.files("iterserve.bench").joinpath("data", PERPLEXITY_TEXT).read_text()


@torch.inference_mode()
def token_logprobs(runner: Any, token_ids: list[int]) -> list[float]:
    """log p(token i | tokens < i) for i >= 1 under ``runner``'s model (a
    :class:`~iterserve.executor.model_runner.TorchModelRunner` whose KV pool holds the whole
    sequence from block 0), prefilled in chunks of :data:`CHUNK_TOKENS`.

    Returns:
        ``len(token_ids) - 1`` natural-log probabilities.
    """
    from iterserve.executor.attention import PagedAttention
    from iterserve.executor.model_runner import prepare_inputs

    model, block_size = runner.model, runner.kv_cache.block_size
    table = list(range(-(-len(token_ids) // block_size)))
    logprobs: list[float] = []
    greedy = SamplingParams(temperature=0.0)
    for start in range(0, len(token_ids), CHUNK_TOKENS):
        chunk = token_ids[start : start + CHUNK_TOKENS]
        scheduled = ScheduledRequest("ppl", chunk, start, table, False, greedy)
        inputs = prepare_inputs([scheduled], block_size, runner.device)
        attention = PagedAttention(runner.kv_cache, inputs.metadata, runner.scale, runner.platform)
        hidden = model(inputs.input_ids, inputs.positions, attention)
        logits = model.compute_logits(hidden).float().log_softmax(dim=-1)  # [chunk, vocab]
        following = token_ids[start + 1 : start + 1 + len(chunk)]
        rows = torch.arange(len(following))
        logprobs += logits[rows, torch.tensor(following)].tolist()
    return logprobs


@dataclass(frozen=True)
class Agreement:
    """Greedy continuations of one mode against bfloat16's, over the same prompts.

    Attributes:
        exact: fraction of prompts whose whole continuation is bfloat16's.
        prefix: mean fraction of each continuation generated before the first difference.
        first_token: fraction of prompts whose first generated token is bfloat16's.
    """

    exact: float
    prefix: float
    first_token: float


def agreement(reference: list[list[int]], other: list[list[int]]) -> Agreement:
    """Compare greedy continuations (token ids, one list per prompt) with the reference's."""
    prefixes, exact, first = [], 0, 0
    for ref, out in zip(reference, other, strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b),
            min(len(ref), len(out)),
        )
        exact += ref == out
        first += bool(ref and out and ref[0] == out[0])
        prefixes.append(same / max(len(ref), 1))
    n = max(len(reference), 1)
    return Agreement(exact / n, sum(prefixes) / n, first / n)


@dataclass(frozen=True)
class QualityRow:
    mode: str
    perplexity: float
    tokens: int
    agreement: Agreement | None  # None for bfloat16 itself
    plan: str  # what the mode chose on this machine


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_quality(
    modes: list[str],
    prompts: list[str],
    max_tokens: int,
    model: str = "default",
    forced: dict[str, int] | None = None,
) -> list[QualityRow]:
    """Perplexity and greedy agreement of each mode (``none`` first: the reference), each on
    a freshly built engine.

    Args:
        modes: e.g. ``["none", "int8", "q4", "int8+kv8"]``
            (:func:`~iterserve.bench.common.quantization_mode`); ``none`` is added first when
            missing.
        prompts: the greedy-agreement prompts.
        max_tokens: greedy tokens generated per prompt.
        forced: ``--quantization`` -> ``ITERSERVE_QUANTIZED_MAX_ROWS`` while it is built (a
            kernel forced at every batch size), instead of the crossover measured.
    """
    from iterserve.bench.common import quantization_mode
    from iterserve.llm import LLM

    modes = ["none", *(m for m in modes if m != "none")]
    forced = forced or {}
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    text_ids: list[int] | None = None
    outputs: dict[str, list[list[int]]] = {}
    rows = []
    for mode in modes:
        num_blocks = 4096 // BLOCK_SIZE + len(prompts) * 8
        weights, kv_cache_dtype = quantization_mode(mode)
        env = {"ITERSERVE_QUANTIZED_MAX_ROWS": str(forced[weights])} if weights in forced else {}
        settings = {"quantization": weights, "kv_cache_dtype": kv_cache_dtype}
        with _environ(env), LLM(model=model, num_kv_blocks=num_blocks, **settings) as llm:
            runner = llm.loaded.driver
            if text_ids is None:
                text_ids = llm.tokenizer(perplexity_text()).input_ids[:4096]
            lps = token_logprobs(runner, text_ids)
            results = llm.generate(prompts, greedy)
            outputs[mode] = [list(r.outputs[0].token_ids) for r in results]
            plan = runner.model.quantization_plan
        rows.append(
            QualityRow(
                mode=mode,
                perplexity=math.exp(-sum(lps) / len(lps)),
                tokens=len(lps) + 1,
                agreement=None if mode == "none" else agreement(outputs["none"], outputs[mode]),
                plan=plan.describe() if plan is not None else "bf16",
            )
        )
    return rows
