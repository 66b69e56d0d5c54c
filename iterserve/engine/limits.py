"""What a request is checked against before it is queued (no engine needed: picklable)."""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.config import DEFAULT_TIER_NAME, MAX_JSON_INT, SchedulerConfig
from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """The model's and the pool's limits, and the tiers, as of one moment.

    Attributes:
        vocab_size: token ids must be below it.
        max_model_len: prompt + max_tokens must fit (tokens).
        num_kv_blocks, block_size: the prompt alone must fit the whole pool.
        has_tokenizer: stop strings need one.
        scheduler: the scheduler settings (tiers resolve priorities).
    """

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    has_tokenizer: bool
    scheduler: SchedulerConfig

    def resolve_priority(self, priority: int | str | None) -> int:
        """An integer priority from an integer, a tier name or None (the default tier).

        Raises:
            InvalidRequestError: unknown tier name or a non-integer.
        """
        tiers = self.scheduler
        if priority is None:
            default = tiers.tier_named(DEFAULT_TIER_NAME)
            return default.priority if default else max(t.priority for t in tiers.tiers)
        if isinstance(priority, str):
            named = tiers.tier_named(priority)
            if named is None:
                names = [t.name for t in tiers.tiers]
                raise InvalidRequestError(
                    f"unknown priority tier {priority!r} (tiers: {names})", "priority"
                )
            return named.priority
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or abs(priority) >= MAX_JSON_INT
        ):
            raise InvalidRequestError(
                f"priority must be an integer in (-2**53, 2**53) or a tier name, "
                f"got {str(priority)[:40]!r}",
                "priority",
            )
        return priority

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`InvalidRequestError` for a request that can never be served."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"expected SamplingParams, got {type(params).__name__}")
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        bad = [
            t
            for t in prompt_token_ids
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}",
                "prompt",
            )
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {num_prompt} prompt tokens and asks for max_tokens={params.max_tokens}",
                "max_tokens" if num_prompt < self.max_model_len else "prompt",
            )
        num_blocks = -(-num_prompt // self.block_size)
        if num_blocks > self.num_kv_blocks:
            raise InvalidRequestError(
                f"the prompt ({num_prompt} tokens) needs {num_blocks} KV blocks but the whole "
                f"pool has {self.num_kv_blocks} blocks of {self.block_size} tokens",
                "prompt",
            )
        bad_stops = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stops:
            raise InvalidRequestError(
                f"stop_token_ids must be < the vocabulary size {self.vocab_size}, got {bad_stops}",
                "stop_token_ids",
            )
        if params.stop and not self.has_tokenizer:
            raise InvalidRequestError("stop strings need a tokenizer", "stop")
