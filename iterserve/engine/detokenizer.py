"""Incremental detokenization and stop strings.

Text grows with ``tokenizers``' ``DecodeStream``, which returns nothing until a token
completes a character, so a multi-byte character (CJK, emoji) split across tokens never
shows up as U+FFFD. Stop strings are searched in the text as it grows (they may span token
boundaries); text that might still turn out to be the start of a stop string is held back
from streaming until the next token decides it (as vLLM does).
"""

from __future__ import annotations

from typing import Any

from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.tokenizer import Tokenizer

# Prompt tokens fed to the stream first, so the first output token decodes in context
# (SentencePiece tokenizers drop a leading space without it).
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """The output text of one completion, one token at a time.

    Args:
        tokenizer: its ``backend_tokenizer`` (a Hugging Face one's) streams the text; one
            without a ``backend_tokenizer`` decodes each token alone (``decode([token_id])``).
        prompt_token_ids: the prompt, for context.
        params: ``stop``, ``include_stop_str_in_output``, ``skip_special_tokens``.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:  # a tokenizer whose tokens decode alone (the simulator's)
            skip = params.skip_special_tokens
            self._step: Any = lambda token_id: tokenizer.decode([token_id], skip)
        else:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(
                prompt_token_ids[-_CONTEXT_TOKENS:], skip_special_tokens=params.skip_special_tokens
            )
            self._step = lambda token_id: stream.step(backend, token_id)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.stop_string: str | None = None

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Decode one more token; returns the stop string it completed, if any (the text is
        then cut before it, or after it with ``include_stop_str_in_output``). With
        ``check_stop`` False (``min_tokens`` not reached) stop strings are not searched."""
        piece = self._step(token_id)
        if not piece:
            return None
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        if not self.stop or not check_stop:
            return None
        found = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(i, s) for i, s in found if i >= 0]
        if not hits:
            return None
        idx, stop = min(hits)
        self.text = self.text[: idx + len(stop)] if self.include_stop else self.text[:idx]
        self.stop_string = stop
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text that may be streamed now: all of it once finished, else without the tail that
        could still be the start of a stop string."""
        return self.text[: self.num_visible_chars(finished)]

    def num_visible_chars(self, finished: bool) -> int:
        """Length of :meth:`visible_text` (deltas slice only the new part)."""
        if finished or not self._hold:
            return len(self.text)
        return max(0, len(self.text) - self._hold)
