"""Per-request sampling parameters, named and defaulted as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the output tokens of one request.

    Attributes:
        max_tokens: most output tokens to generate (>= 1).
        temperature: 0 is greedy (argmax); > 0 samples from softmax(logits / temperature).
        ignore_eos: keep generating after the end-of-sequence token.
        stop_token_ids: extra token ids that end the request (the token is kept in the output).

    Raises:
        InvalidRequestError: when a value is out of range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(
                f"temperature must be in [0, 100], got {self.temperature}", "temperature"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
