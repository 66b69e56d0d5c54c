"""Completions and chat completions: request -> engine requests -> OpenAI responses.

One HTTP request becomes one engine request per prompt (a batch of prompts in
``/v1/completions`` becomes several); each engine request yields cumulative outputs, from
which the SSE deltas are cut. All engine streams of a request and a disconnect watcher feed
one queue, so a client that goes away, streaming or not and even while still queued, is
noticed at once and its engine requests are aborted (their KV blocks are freed at the
engine's next iteration boundary).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from iterserve.engine.async_engine import (
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
)
from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from iterserve.engine.sampling_params import SamplingParams
from iterserve.server.admission import Rejected
from iterserve.server.metrics import RequestTracker
from iterserve.server.protocol import (
    MAX_CHAT_TOP_LOGPROBS,
    MAX_COMPLETION_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    not_supported,
)
from iterserve.server.state import ServerState

logger = logging.getLogger(__name__)

_DISCONNECTED = object()
# Prompts x n of one HTTP request (each is a sequence in the batch).
MAX_SEQUENCES_PER_REQUEST = 256


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None


@dataclass
class _Choice:
    """What has been sent of one choice (stream) or its final output."""

    text: str = ""
    num_tokens: int = 0
    offset: int = 0  # text_offset of the next logprobs token (completions)
    finished: bool = False
    output: CompletionOutput | None = None


@dataclass
class _Job:
    """One HTTP generation request: its engine requests and their bookkeeping."""

    kind: str  # "completion" | "chat"
    request_id: str
    prompts: list[_Prompt]
    params: SamplingParams
    priority: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # completions: top count; chat: top_logprobs (None: off)
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, _Choice] = field(default_factory=dict)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)
    disconnected: bool = False

    def engine_id(self, prompt_idx: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{prompt_idx}"

    def usage(self) -> dict[str, Any]:
        num_prompt = sum(len(p.token_ids) for p in self.prompts)
        num_completion = sum(
            len(c.output.token_ids) for c in self.choices.values() if c.output is not None
        )
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.num_cached_tokens.values())},
        }


@dataclass
class _Run:
    """The running engine requests of a job: their outputs queue, tasks and disconnect watcher."""

    queue: asyncio.Queue[Any]
    tasks: list[asyncio.Task[None]]
    watcher: asyncio.Task[None] | None


def _bad_request(e: InvalidRequestError) -> APIError:
    return APIError(400, str(e), param=e.param)


class OpenAIServing:
    """The two generation endpoints, around a started :class:`ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        tokenizer = state.tokenizer

        @lru_cache(maxsize=65536)
        def token_text(token_id: int) -> str:
            return str(tokenizer.decode([token_id]))

        self.token_text = token_text

    # ----------------------------------------------------------------- building requests

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.state.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        Raises:
            APIError: text the tokenizer cannot take (lone surrogates): 400.
        """
        try:
            ids = self.state.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        except Exception as e:
            raise APIError(400, f"the prompt is not valid text: {e}", param="prompt") from e
        return list(ids)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode` on a worker thread: a long prompt must not stall the event loop."""
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

    async def chat_prompt_async(
        self, messages: list[Any], add_generation_prompt: bool = True
    ) -> _Prompt:
        return await asyncio.to_thread(self.chat_prompt, messages, add_generation_prompt)

    def chat_prompt(self, messages: list[Any], add_generation_prompt: bool = True) -> _Prompt:
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
        return _Prompt(self.encode(text, add_special_tokens=False), text)

    async def _completion_prompts(self, req: CompletionRequest) -> list[_Prompt]:
        prompt = req.prompt
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]  # type: ignore[list-item]  # one prompt of token ids
        else:
            items = list(prompt)  # type: ignore[arg-type]
        if not items:
            raise APIError(400, "the prompt is empty", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError(400, "the prompt is empty", param="prompt")
                prompts.append(_Prompt(await self.encode_async(item), item))
            else:
                text = str(self.state.tokenizer.decode(item)) if req.echo else None
                prompts.append(_Prompt(list(item), text))
        if len(prompts) * req.n > MAX_SEQUENCES_PER_REQUEST:
            raise APIError(
                400,
                f"{len(prompts)} prompts x n={req.n} is over {MAX_SEQUENCES_PER_REQUEST} "
                "sequences per request; split the batch",
                param="prompt",
            )
        return prompts

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
            raise _bad_request(e) from e

    def _job(self, kind: str, req: Any, prompts: list[_Prompt], max_tokens: int | None) -> _Job:
        """Validate everything about a request; raises APIError (400) before anything runs."""
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
        params = self._sampling_params(req, max_tokens, logprobs)
        limits = state.engine.limits
        assert limits is not None
        try:
            for p in prompts:
                limits.validate(p.token_ids, params)
            priority = limits.resolve_priority(req.priority)
        except InvalidRequestError as e:
            raise _bad_request(e) from e
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream=true", param="stream_options")
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        return _Job(
            kind=kind,
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            prompts=prompts,
            params=params,
            priority=priority,
            stream=req.stream,
            include_usage=include_usage,
            echo=getattr(req, "echo", False),
            logprobs=logprobs,
        )

    # ----------------------------------------------------------------- endpoints

    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        feature = req.unsupported()
        if feature:
            raise not_supported(feature)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default
        job = self._job("completion", req, await self._completion_prompts(req), max_tokens)
        return await self._serve(job, raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        feature = req.unsupported()
        if feature:
            raise not_supported(feature)
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(req, name)
            if value is not None and value < 1:
                raise APIError(400, f"{name} must be an integer >= 1, got {value}", param=name)
        prompt = await self.chat_prompt_async(req.messages, req.add_generation_prompt)
        if not prompt.token_ids:
            raise APIError(400, "the prompt is empty", param="messages")
        max_tokens = req.max_completion_tokens
        max_tokens = max_tokens if max_tokens is not None else req.max_tokens
        return await self._serve(self._job("chat", req, [prompt], max_tokens), raw)

    async def _serve(self, job: _Job, raw: Request) -> Any:
        state = self.state
        try:
            state.admission.check(state.settings.config, job.priority, len(job.prompts))
        except Rejected as e:
            state.metrics.rejected.labels(reason=e.reason).inc()
            raise
        raw.state.request_id = job.request_id
        raw.state.tier = state.settings.config.tier_for(job.priority).name
        if state.server_config.log_prompts:
            raw.state.prompts = [p.text for p in job.prompts]
        outputs = self._outputs(job, self._start(job, raw))
        if job.stream:
            return StreamingResponse(
                self._sse(job, outputs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id},
            )
        async with contextlib.aclosing(outputs) as stream:
            async for _ in stream:
                pass
        if job.disconnected:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        body = self._full_response(job)
        return JSONResponse(body, headers={"X-Request-Id": job.request_id})

    # ----------------------------------------------------------------- engine streams

    def _start(self, job: _Job, raw: Request) -> _Run:
        """Queue the job's engine requests now (the admission count must include them before
        the next request is checked) and run them on tasks that own their bookkeeping, so that
        nothing leaks even if the response body is never iterated."""
        state = self.state
        tier = state.settings.config.tier_for(job.priority).name
        run = _Run(asyncio.Queue(), [], None)
        for i in range(len(job.prompts)):
            state.admission.enqueue(job.engine_id(i), job.priority)

        async def produce(i: int) -> None:
            prompt, engine_id = job.prompts[i], job.engine_id(i)
            tracker = RequestTracker(state.metrics, tier)
            reason = "abort"  # unless it finishes or fails
            try:
                async for out in state.engine.generate(
                    engine_id, prompt.token_ids, job.params, prompt.text, job.priority
                ):
                    if tracker.on_output(out):
                        state.admission.left_queue(engine_id)
                    if out.finished:
                        reason = out.outputs[0].finish_reason or "abort"
                    await run.queue.put((i, out))
            except Exception as e:
                if not isinstance(e, RequestAbortedError):
                    reason = "error"
                await run.queue.put((i, e))
            finally:
                state.admission.left_queue(engine_id, started=False)
                tracker.finish(reason)

        async def watch_disconnect() -> None:
            while (await raw.receive())["type"] != "http.disconnect":
                pass
            for task in run.tasks:  # abort the engine requests now, read or not
                task.cancel()
            await run.queue.put(_DISCONNECTED)

        run.tasks.extend(asyncio.create_task(produce(i)) for i in range(len(job.prompts)))
        run.watcher = asyncio.create_task(watch_disconnect())
        return run

    async def _outputs(
        self, job: _Job, run: _Run
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Outputs of every engine request of the job, as they come, until all finished or the
        client disconnects. Raises APIError (in the stream) if the engine fails them."""
        pending = set(range(len(job.prompts)))
        try:
            while pending:
                item = await run.queue.get()
                if item is _DISCONNECTED:
                    job.disconnected = True
                    return
                i, out = item
                if isinstance(out, BaseException):
                    raise _engine_error(out)
                job.num_cached_tokens[i] = out.num_cached_tokens
                for c in out.outputs:
                    job.choices.setdefault(self._choice_index(job, i, c), _Choice()).output = c
                if out.finished:
                    pending.discard(i)
                yield i, out
        finally:
            # Disconnected, another prompt failed, or the reader left: abort what still runs.
            tasks = [*run.tasks, run.watcher]
            for task in tasks:
                if task is not None:
                    task.cancel()
            await asyncio.gather(*[t for t in tasks if t is not None], return_exceptions=True)

    # ----------------------------------------------------------------- responses

    def _choice_index(self, job: _Job, prompt_idx: int, c: CompletionOutput) -> int:
        return prompt_idx * job.params.n + c.index

    def _completion_logprobs(
        self, entries: list[TokenLogprobs], offset: int
    ) -> dict[str, list[Any]]:
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, entries: list[TokenLogprobs]) -> dict[str, list[Any]]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                for e in entries
            ]
        }

    def _full_response(self, job: _Job) -> dict[str, Any]:
        choices = []
        for index in sorted(job.choices):
            c = job.choices[index].output
            assert c is not None
            entries = c.logprobs or []
            if job.kind == "completion":
                prompt = job.prompts[index // job.params.n]
                prefix = (prompt.text or "") if job.echo else ""
                logprobs = None
                if job.logprobs is not None:
                    logprobs = self._completion_logprobs(entries, len(prefix))
                choices.append(
                    {
                        "index": index,
                        "text": prefix + c.text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": None if job.logprobs is None else self._chat_logprobs(entries),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return {
            "id": job.request_id,
            "object": "text_completion" if job.kind == "completion" else "chat.completion",
            "created": job.created,
            "model": self.state.model_name,
            "choices": choices,
            "usage": job.usage(),
        }

    async def _sse(
        self, job: _Job, outputs: AsyncGenerator[tuple[int, RequestOutput], None]
    ) -> AsyncIterator[str]:
        """The SSE body: chunks as outputs arrive, the usage chunk, ``[DONE]``."""
        chunk_object = "text_completion" if job.kind == "completion" else "chat.completion.chunk"

        def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            chunk: dict[str, Any] = {
                "id": job.request_id,
                "object": chunk_object,
                "created": job.created,
                "model": self.state.model_name,
                "choices": choices,
            }
            if job.include_usage:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        async with contextlib.aclosing(outputs) as stream:
            if job.kind == "chat":
                first = [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(len(job.prompts) * job.params.n)
                ]
                yield event(first)
            try:
                async for prompt_idx, out in stream:
                    choices = [
                        chunk
                        for c in out.outputs
                        if (chunk := self._delta(job, prompt_idx, c)) is not None
                    ]
                    if choices:
                        yield event(choices)
            except APIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
        if job.include_usage:
            chunk = {
                "id": job.request_id,
                "object": chunk_object,
                "created": job.created,
                "model": self.state.model_name,
                "choices": [],
                "usage": job.usage(),
            }
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    def _delta(self, job: _Job, prompt_idx: int, c: CompletionOutput) -> dict[str, Any] | None:
        """The chunk choice for what is new in ``c`` since the last one sent, or None."""
        index = self._choice_index(job, prompt_idx, c)
        sent = job.choices[index]
        if sent.finished:
            return None
        text = c.text[len(sent.text) :]
        new_entries = (c.logprobs or [])[sent.num_tokens :] if job.logprobs is not None else []
        if not text and not new_entries and c.finish_reason is None:
            return None
        if job.kind == "completion" and job.echo and sent.num_tokens == 0 and not sent.text:
            echo = job.prompts[prompt_idx].text or ""
            text = echo + text
            sent.offset = len(echo)
        sent.text = c.text
        sent.num_tokens = len(c.token_ids)
        sent.finished = c.finish_reason is not None
        choice: dict[str, Any] = {"index": index}
        if job.kind == "completion":
            choice["text"] = text
            choice["logprobs"] = (
                self._completion_logprobs(new_entries, sent.offset)
                if job.logprobs is not None
                else None
            )
            if choice["logprobs"] is not None:
                sent.offset += sum(len(t) for t in choice["logprobs"]["tokens"])
        else:
            choice["delta"] = {"content": text} if text else {}
            choice["logprobs"] = (
                self._chat_logprobs(new_entries) if job.logprobs is not None else None
            )
        choice["finish_reason"] = c.finish_reason
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
        return choice


def _engine_error(e: BaseException) -> BaseException:
    if isinstance(e, InvalidRequestError):
        return _bad_request(e)
    if isinstance(e, RequestFailedError):
        return APIError(500, f"the engine failed this request: {e}", type="internal_error")
    if isinstance(e, RequestAbortedError):
        return APIError(503, f"request aborted: {e}", "service_unavailable_error", code="aborted")
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running: {e}", type="service_unavailable_error")
    return e
