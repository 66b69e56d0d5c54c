"""The offline Python API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
import operator
import typing
import weakref
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

from iterserve.config import EngineConfig
from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.factory import build_engine
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.build import LoadedModel, build

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Load a model and generate with continuous batching.

    Every keyword is a field of the engine configs (see ``iterserve.config``); an unknown one is
    a ``TypeError`` and an invalid value a ``ConfigError``.

    :meth:`close` (or leaving a ``with`` block, or garbage collection) stops what the model
    holds outside this object (a tensor-parallel replica's worker processes), so that another
    ``LLM`` can be built in the same process.

    Example::

        with LLM(model="default", dtype="float32", num_kv_blocks=64) as llm:
            outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        loaded = build(EngineConfig.from_kwargs(model=model, **kwargs))
        try:
            self.engine = build_engine(loaded.config, loaded.runner, loaded.tokenizer, loaded.info)
        except BaseException:
            loaded.close()
            raise
        self.loaded: LoadedModel = loaded
        self.tokenizer = loaded.tokenizer
        # Holds ``loaded``, never ``self``: collecting this LLM closes the model.
        self._finalizer = weakref.finalize(self, loaded.close)
        self._ids = itertools.count()
        # Why this LLM can no longer generate, though it is open (None: it can).
        self._broken: str | None = None

    @property
    def config(self) -> EngineConfig:
        return self.loaded.config

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any) and leave the process group; idempotent.
        Generating afterwards raises ``RuntimeError``."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in input order.

        A prompt is text, a list of token ids, or ``{"prompt_token_ids": [...]}`` /
        ``{"prompt": "..."}``. ``sampling_params`` is one for all or a list, one per prompt.

        Raises:
            InvalidRequestError: some prompt can never be served; nothing was run.
            RuntimeError: this ``LLM`` is closed, or a tensor-parallel step of it was
                interrupted (its ranks are out of step: close it and build a new one).
        """
        if self.closed:
            raise RuntimeError("this LLM is closed: build a new one to generate")
        if self._broken is not None:
            raise RuntimeError(self._broken)
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        elif isinstance(sampling_params, list | tuple):
            params_list = list(sampling_params)
        else:
            raise TypeError(
                f"sampling_params must be SamplingParams or a list of them, got "
                f"{type(sampling_params).__name__}"
            )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        encoded = [self._encode(p) for p in prompt_list]
        for (token_ids, _), params in zip(encoded, params_list, strict=True):
            self.engine.validate(token_ids, params)
        return self._run(encoded, params_list)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate."""
        conversations = typing.cast(
            list[list[dict[str, str]]],
            messages if messages and isinstance(messages[0], list) else [messages],
        )
        texts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        # The template spells out its special tokens: the tokenizer adds none on top.
        prompts: list[PromptType] = [
            {"prompt_token_ids": self.tokenizer(t, add_special_tokens=False).input_ids, "prompt": t}
            for t in texts
        ]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(
        self, conversation: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of a conversation under the model's chat template."""
        return str(
            self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def _encode(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                return _token_ids(prompt["prompt_token_ids"]), text if isinstance(
                    text, str
                ) else None
            if isinstance(prompt.get("prompt"), str):
                return self._encode(prompt["prompt"])
            raise InvalidRequestError(
                "a prompt dict needs a 'prompt' string or 'prompt_token_ids'", "prompt"
            )
        return _token_ids(prompt), None

    def _run(
        self, encoded: list[tuple[list[int], str | None]], params_list: list[SamplingParams]
    ) -> list[RequestOutput]:
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(encoded)
        try:
            for i, ((token_ids, text), params) in enumerate(zip(encoded, params_list, strict=True)):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, token_ids, params, prompt=text)
                order[request_id] = i
            pending = len(order)
            while pending:
                for out in self._step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        pending -= 1
        finally:
            # On any error, leave nothing of this call queued in the engine.
            self.engine.abort_request([r for r, i in order.items() if results[i] is None])
        return [r for r in results if r is not None]

    def _step(self) -> list[RequestOutput]:
        """One engine step. A tensor-parallel step that does not return (an interrupt, an
        error) may leave the ranks in different collectives: the LLM then refuses to generate
        rather than send the next step into a desynchronised process group."""
        try:
            return self.engine.step()
        except BaseException as e:
            if self.config.parallel.tensor_parallel_size > 1:
                self._broken = (
                    f"this LLM's tensor-parallel step was interrupted ({type(e).__name__}): its "
                    "ranks are out of step; close() it and build a new one"
                )
            raise


def _token_ids(prompt: object) -> list[int]:
    """Token ids from a sequence of integers (numpy integers and arrays too).

    Raises:
        InvalidRequestError: anything else.
    """
    if isinstance(prompt, str | bytes | dict) or not isinstance(prompt, Iterable):
        raise InvalidRequestError(
            f"a prompt is text, a list of token ids or a dict, got {type(prompt).__name__}",
            "prompt",
        )
    try:
        return [_index(t) for t in prompt]
    except TypeError as e:
        raise InvalidRequestError(f"prompt token ids must be integers: {e}", "prompt") from e


def _index(token: object) -> int:
    if isinstance(token, bool) or not hasattr(token, "__index__"):
        raise TypeError(f"{token!r} is not an integer")
    return operator.index(token)


def _as_prompt_list(prompts: object) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise InvalidRequestError(
            f"prompts must be text, token ids, a dict or a list of these, got "
            f"{type(prompts).__name__}",
            "prompt",
        )
    prompt_list = list(prompts)
    if not prompt_list:
        raise InvalidRequestError("no prompts given", "prompt")
    if not any(isinstance(p, str | dict) or hasattr(p, "__len__") for p in prompt_list):
        # One prompt of token ids (non-integers are rejected when it is encoded).
        return [typing.cast(PromptType, prompt_list)]
    return typing.cast(list[PromptType], prompt_list)
