"""The tokenizer as the engine and ``LLM`` see it: a structural type that a Hugging Face
tokenizer and the simulator's (:mod:`iterserve.sim.tokenizer`) both satisfy."""

from __future__ import annotations

from typing import Any, Protocol


class Encoding(Protocol):
    """What encoding a text returns: its token ids."""

    @property
    def input_ids(self) -> list[int]: ...


class Tokenizer(Protocol):
    """Encode prompts, decode output tokens, and render chat conversations.

    The detokenizer also uses a Hugging Face ``backend_tokenizer`` when there is one (for
    incremental decoding); without it each token is decoded alone.
    """

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's end-of-sequence id (None: it has none)."""
        ...

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Encoding:
        """Token ids of ``text`` (``add_special_tokens``: with the BOS the model expects)."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]:
        """The text of ``token_ids`` (a ``str``; Hugging Face's type also covers batches)."""
        ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool = ...,
        add_generation_prompt: bool = ...,
    ) -> Any:
        """The prompt text of ``conversation`` (with ``tokenize=False``)."""
        ...
