"""Completions and chat completions: validate once, admit, run, answer in JSON or SSE.

:class:`OpenAIServing` turns an OpenAI request into a validated
:class:`~iterserve.server.generation.Generation` (tokenization, ``SamplingParams``, the
engine's ``RequestLimits``, the priority tier: every check happens here, once, before
anything is queued), asks admission, runs it (:class:`~iterserve.server.generation.GenerationRun`)
and hands what arrives to the endpoint's formatter (:mod:`~iterserve.server.completions`,
:mod:`~iterserve.server.chat`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.messages import EngineDeadError
from iterserve.engine.sampling_params import SamplingParams
from iterserve.server.admission import Rejected
from iterserve.server.chat import ChatFormatter
from iterserve.server.completions import CompletionFormatter
from iterserve.server.generation import (
    Generation,
    GenerationRun,
    Prompt,
    bad_request,
    engine_error,
)
from iterserve.server.identity import AS_SENT, resolve_granted_priority
from iterserve.server.protocol import (
    MAX_CHAT_TOP_LOGPROBS,
    MAX_COMPLETION_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from iterserve.server.state import ServerState
from iterserve.server.streaming import WatchedStreamingResponse
from iterserve.server.tenants import TENANT_HEADER, resolve_tenant

logger = logging.getLogger(__name__)

# Prompts x n of one HTTP request (each is a sequence in the batch).
MAX_SEQUENCES_PER_REQUEST = 256

Formatter = CompletionFormatter | ChatFormatter


class OpenAIServing:
    """The two generation endpoints, around a started :class:`ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        tokenizer = state.tokenizer

        @lru_cache(maxsize=65536)
        def token_text(token_id: int) -> str:
            return str(tokenizer.decode([token_id]))

        self.token_text = token_text
        self.completion_formatter = CompletionFormatter(state.model_name, token_text)
        self.chat_formatter = ChatFormatter(state.model_name, token_text)

    # ----------------------------------------------------------------- building requests

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.state.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def encode(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        """Token ids of ``text``.

        Raises:
            APIError: text the tokenizer cannot take (lone surrogates): 400.
        """
        try:
            ids = self.state.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        except Exception as e:
            raise APIError(400, f"{param}: not valid text: {e}", param=param) from e
        return list(ids)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode` on a worker thread: a long prompt must not stall the event loop."""
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

    async def chat_prompt_async(
        self, messages: list[Any], add_generation_prompt: bool = True
    ) -> Prompt:
        return await asyncio.to_thread(self.chat_prompt, messages, add_generation_prompt)

    def chat_prompt(self, messages: list[Any], add_generation_prompt: bool = True) -> Prompt:
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = str(
                self.state.tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=add_generation_prompt
                )
            )
        except Exception as e:  # the template's own checks (jinja raise_exception, ...)
            raise APIError(400, f"the chat template rejects these messages: {e}", "messages") from e
        # The template spells out its special tokens: the tokenizer adds none on top.
        return Prompt(self.encode(text, add_special_tokens=False, param="messages"), text)

    async def _completion_prompts(self, req: CompletionRequest) -> list[Prompt]:
        prompt = req.prompt
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]  # type: ignore[list-item]  # one prompt of token ids
        else:
            items = list(prompt)  # type: ignore[arg-type]
        if not items:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(items) > MAX_SEQUENCES_PER_REQUEST:  # before any of them is tokenized
            raise APIError(
                400,
                f"{len(items)} prompts are over {MAX_SEQUENCES_PER_REQUEST} sequences per "
                "request; split the batch",
                param="prompt",
            )
        prompts = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError(400, "the prompt is empty", param="prompt")
                prompts.append(Prompt(await self.encode_async(item), item))
            else:  # text for echo once the ids are validated (_echo_texts)
                prompts.append(Prompt(list(item), None))
        return prompts

    def _echo_texts(self, gen: Generation) -> None:
        """The text of each token-id prompt, for ``echo``: decoded only after ``_generation``
        checked the ids (the tokenizer raises OverflowError on ids outside its range)."""
        if gen.echo:
            for p in gen.prompts:
                if p.text is None:
                    p.text = str(self.state.tokenizer.decode(p.token_ids))

    def _sampling_params(self, req: Any, max_tokens: int, logprobs: int | None) -> SamplingParams:
        kwargs: dict[str, Any] = {
            "n": req.n,
            "max_tokens": max_tokens,
            "min_tokens": req.min_tokens,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "seed": req.seed,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "logprobs": logprobs,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(req, name) is not None:
                kwargs[name] = getattr(req, name)
        try:
            return SamplingParams(**kwargs)
        except InvalidRequestError as e:
            raise bad_request(e) from e

    def _generation(
        self, kind: str, req: Any, raw: Request, prompts: list[Prompt], max_tokens: int | None
    ) -> Generation:
        """Validate everything about a request, once; raises APIError (400) before anything
        runs. Its arrival time is when the HTTP request was accepted (the middleware's)."""
        state = self.state
        longest = max(len(p.token_ids) for p in prompts)
        if max_tokens is None:  # chat: the rest of the context
            max_tokens = max(1, state.max_model_len - longest)
        if kind == "completion":
            logprobs = req.logprobs
            if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
                raise APIError(
                    400, f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}]", param="logprobs"
                )
        else:
            if req.top_logprobs is not None and not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
                raise APIError(
                    400,
                    f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}]",
                    param="top_logprobs",
                )
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, max_tokens, logprobs)  # n is in range from here
        if len(prompts) * params.n > MAX_SEQUENCES_PER_REQUEST:
            raise APIError(
                400,
                f"{len(prompts)} prompts x n={params.n} is over {MAX_SEQUENCES_PER_REQUEST} "
                "sequences per request; split the batch",
                param="prompt",
            )
        limits = state.engine.limits
        try:
            for p in prompts:
                limits.validate(p.token_ids, params)
            grant = getattr(raw.state, "grant", AS_SENT)
            priority, tier = resolve_granted_priority(
                req.priority, grant, limits, state.settings.config
            )
        except InvalidRequestError as e:
            raise bad_request(e) from e
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream=true", param="stream_options")
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        return Generation(
            kind=kind,
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            prompts=prompts,
            params=params,
            priority=priority,
            tier=tier,
            arrival_time=raw.state.arrival_time,
            created=int(time.time()),
            stream=req.stream,
            include_usage=include_usage,
            echo=getattr(req, "echo", False),
            logprobs=logprobs,
            tenant=grant.tenant or resolve_tenant(raw.headers.get(TENANT_HEADER), req.user),
        )

    # ----------------------------------------------------------------- endpoints

    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        if (error := req.unsupported()) is not None:
            raise error
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default
        prompts = await self._completion_prompts(req)
        gen = self._generation("completion", req, raw, prompts, max_tokens)
        self._echo_texts(gen)
        return await self._serve(gen, raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        if (error := req.unsupported()) is not None:
            raise error
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(req, name)
            if value is not None and value < 1:
                raise APIError(400, f"{name} must be an integer >= 1, got {value}", param=name)
        prompt = await self.chat_prompt_async(req.messages, req.add_generation_prompt)
        if not prompt.token_ids:
            raise APIError(400, "the prompt is empty", param="messages")
        max_tokens = req.max_completion_tokens
        max_tokens = max_tokens if max_tokens is not None else req.max_tokens
        return await self._serve(self._generation("chat", req, raw, [prompt], max_tokens), raw)

    async def _serve(self, gen: Generation, raw: Request) -> Any:
        state = self.state
        if not state.engine.is_running:  # known now: a 503, not a stream that fails at once
            raise engine_error(EngineDeadError("the engine is not running"))
        state.metrics.tenant_label(gen.tenant)  # labels go to tenants in arrival order
        try:
            config = state.settings.config
            state.admission.check(config, gen.priority, len(gen.prompts), gen.tenant)
        except Rejected as e:
            state.metrics.count_rejection(e.reason, gen.tenant)
            raise
        raw.state.request_id = gen.request_id
        raw.state.tier = gen.tier
        if state.server_config.log_prompts:
            raw.state.prompts = [p.text for p in gen.prompts]
        formatter = self.completion_formatter if gen.kind == "completion" else self.chat_formatter
        run = GenerationRun(state, gen, raw)
        run.start()
        if gen.stream:
            stall_timeout_s = state.server_config.stream_stall_timeout_s
            response = WatchedStreamingResponse(
                self._sse(gen, run, formatter),
                gen.request_id,
                stall_timeout_s or None,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": gen.request_id},
            )
            run.on_overflow = response.drop
            return response
        async with contextlib.aclosing(run.deltas()) as deltas:
            async for _ in deltas:
                pass
        if gen.disconnected:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        body = formatter.response(gen).model_dump(mode="json")
        return JSONResponse(body, headers={"X-Request-Id": gen.request_id})

    async def _sse(self, gen: Generation, run: GenerationRun, formatter: Any) -> AsyncIterator[str]:
        """The SSE body: chunks as deltas arrive, the usage chunk, ``[DONE]``."""
        # Without stream_options.include_usage the chunks carry no usage key at all.
        exclude = None if gen.include_usage else {"usage"}

        def event(choices: list[Any]) -> str:
            chunk = formatter.chunk(gen, choices)
            return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"

        async with contextlib.aclosing(run.deltas()) as deltas:
            first = formatter.first_choices(gen)
            if first:
                yield event(first)
            try:
                async for pairs in deltas:
                    choices = [
                        choice
                        for index, d in pairs
                        if (choice := formatter.stream_choice(gen, index, d)) is not None
                    ]
                    if choices:
                        yield event(choices)
            except APIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
        if gen.include_usage:
            chunk = formatter.chunk(gen, [])
            chunk.usage = gen.usage()
            yield f"data: {chunk.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"
