"""Per-request sampling parameters, named and defaulted as in vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from iterserve.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
# Temperatures below this sample greedily (as vLLM): dividing logits by less overflows.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_N = 128
MAX_TEMPERATURE = 100.0
MAX_ABS_PENALTY = 2.0  # presence_penalty and frequency_penalty are in [-2, 2]
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0
MAX_STOP_STRINGS = 16
# Larger values mean "no top-k" anyway; the bound keeps them inside int32 tensors.
MAX_TOP_K = 2**31 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, message: str, value: Any) -> None:
    if not ok:
        shown = repr(value)
        if len(shown) > 200:  # a huge stop list must not come back as a huge error
            shown = shown[:200] + f"... ({len(shown)} characters)"
        raise InvalidRequestError(f"{name} {message}, got {shown}", name)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the output tokens of one request (vLLM's names, defaults and order of
    logits processing: min_tokens mask -> penalties -> temperature -> min_p -> top_k/top_p).

    Attributes:
        n: independent completions of the prompt (they share its KV blocks).
        max_tokens: most output tokens per completion (>= 1).
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens exist.
        temperature: 0 is greedy; > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass in (0, 1]; top_k: keep the k best (0 or -1: all);
        min_p: drop tokens whose probability is below ``min_p`` x the best one's.
        presence_penalty, frequency_penalty: in [-2, 2], subtracted per output occurrence
            (OpenAI semantics); repetition_penalty: > 0, divides positive (multiplies
            negative) logits of tokens seen in prompt or output (Keskar et al., 2019, CTRL).
        seed: seeds this request's own generator (completion i of n uses seed + i).
        stop: strings that end a completion; excluded from the text unless
            ``include_stop_str_in_output``. stop_token_ids: ids that end it (kept).
        ignore_eos: keep generating after EOS. logprobs: also return this many top
            alternatives per token (0 = only the chosen token's logprob; None = none).
        skip_special_tokens: leave special tokens out of the text.

    Raises:
        InvalidRequestError: a value has the wrong type or is out of range (``param`` names it).
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        _check(
            stop is None or isinstance(stop, list | tuple),
            "stop",
            "must be a string or a list of strings",
            stop,
        )
        object.__setattr__(self, "stop", tuple(stop or ()))
        ids = self.stop_token_ids
        _check(
            ids is None or isinstance(ids, list | tuple),
            "stop_token_ids",
            "must be a list of integers",
            ids,
        )
        object.__setattr__(self, "stop_token_ids", tuple(ids or ()))
        self._validate()

    def _validate(self) -> None:
        self._validate_lengths()
        self._validate_sampling()
        self._validate_outputs()

    def _validate_lengths(self) -> None:
        _check(
            _is_int(self.n) and 1 <= self.n <= MAX_N,
            "n",
            f"must be an integer in [1, {MAX_N}]",
            self.n,
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            "must be an integer >= 1",
            self.max_tokens,
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be an integer in [0, max_tokens={self.max_tokens}]",
            self.min_tokens,
        )

    def _validate_sampling(self) -> None:
        _check(
            _is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {MAX_TEMPERATURE:g}]",
            self.temperature,
        )
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p
        )
        _check(
            _is_int(self.top_k) and -1 <= self.top_k <= MAX_TOP_K,
            "top_k",
            f"must be -1, 0 (disabled) or a positive integer <= {MAX_TOP_K}",
            self.top_k,
        )
        _check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            "must be in [0, 1]",
            self.min_p,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and abs(value) <= MAX_ABS_PENALTY,
                name,
                f"must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}]",
                value,
            )
        _check(
            _is_number(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]",
            self.repetition_penalty,
        )
        # Completion i of n uses seed + i; torch generators take signed 64-bit seeds.
        _check(
            self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed <= 2**63 - self.n),
            "seed",
            "must be an integer in [-2**63, 2**63 - n]",
            self.seed,
        )

    def _validate_outputs(self) -> None:
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}]",
            self.logprobs,
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            f"must be at most {MAX_STOP_STRINGS} non-empty strings",
            self.stop,
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
            self.stop_token_ids,
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(
                isinstance(getattr(self, name), bool),
                name,
                "must be a boolean",
                getattr(self, name),
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    def child(self, index: int) -> SamplingParams:
        """Params of completion ``index`` of ``n``: one completion, seed + index."""
        import dataclasses

        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)
