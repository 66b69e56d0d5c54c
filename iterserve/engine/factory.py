"""The one place an :class:`~iterserve.engine.llm_engine.LLMEngine` is assembled.

Every replica (``LLM``, the engine process of ``serve``, ``serve --simulate``, ``simulate``
and the benchmarks) is the same engine over a different model runner: the torch runner, the
tensor-parallel runner that wraps it, or the simulated runner. What the runner's start-up
found (the KV pools, the model's vocabulary and EOS ids) comes in as one :class:`ModelInfo`;
the preemption costs are asked of the runner here, when the replica can swap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from iterserve.config import CacheConfig, EngineConfig, GiB
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.messages import Clock, monotonic_clock
from iterserve.engine.outputs import ModelRunner
from iterserve.engine.policy import PreemptionCosts
from iterserve.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What start-up found out about the model and its runner, for the engine.

    Attributes:
        vocab_size: number of token ids the model accepts.
        eos_token_ids: ids that end a request unless ``ignore_eos``.
        num_kv_blocks: blocks in the runner's KV pool.
        num_host_blocks: blocks in the runner's host swap pool (:func:`num_host_blocks`).
        model_dir: where the model and its tokenizer were loaded from (None: no directory a
            client could load a tokenizer from).
    """

    vocab_size: int
    eos_token_ids: frozenset[int]
    num_kv_blocks: int
    num_host_blocks: int = 0
    model_dir: str | None = None


@runtime_checkable
class MeasuresPreemptionCosts(Protocol):
    """A runner that can tell what recomputing and swapping a token cost on its hardware."""

    def measure_preemption_costs(self) -> PreemptionCosts: ...


def num_host_blocks(cache: CacheConfig, bytes_per_block: int) -> int:
    """Blocks of ``bytes_per_block`` bytes (KV of one block, all layers) in ``swap_space``
    GiB of host memory."""
    return int(cache.swap_space * GiB) // bytes_per_block


def build_engine(
    config: EngineConfig,
    runner: ModelRunner,
    tokenizer: Tokenizer | None,
    model: ModelInfo,
    clock: Clock = monotonic_clock,
    preemption_costs: PreemptionCosts | None = None,
) -> LLMEngine:
    """The engine over ``runner``.

    Args:
        config: engine settings, ``model.max_model_len`` resolved.
        runner: executes each iteration (the torch, tensor-parallel or simulated runner).
        tokenizer: for output text and stop strings (None: token ids only).
        model: the pools and vocabulary the runner was built with.
        clock: the engine's seconds (the simulator passes a virtual or scaled clock).
        preemption_costs: known costs; by default, with host blocks and
            ``preemption_mode=auto``, the runner measures them (when it can).

    Raises:
        ValueError: ``config.model.max_model_len`` is not resolved.
    """
    wants_costs = model.num_host_blocks > 0 and config.scheduler.preemption_mode == "auto"
    if preemption_costs is None and wants_costs and isinstance(runner, MeasuresPreemptionCosts):
        preemption_costs = runner.measure_preemption_costs()
        logger.info("preemption costs: %s", preemption_costs)
    return LLMEngine(
        config,
        runner,
        tokenizer,
        num_kv_blocks=model.num_kv_blocks,
        vocab_size=model.vocab_size,
        eos_token_ids=model.eos_token_ids,
        num_host_blocks=model.num_host_blocks,
        preemption_costs=preemption_costs,
        model_dir=model.model_dir,
        clock=clock,
    )
