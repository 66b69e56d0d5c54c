"""A fake :class:`~iterserve.engine.messages.EngineClient` and an in-process server for HTTP tests.

The fake knows the answer: output token ``k`` of a completion is a function of its prompt, its
completion index and ``k`` (:func:`fake_token`), and its text is that token's text under the
real default tokenizer, so a test can check any response exactly. It steps when told
(:meth:`FakeEngineClient.step`) or, with ``auto_step``, on its own task; each step advances
every running request by one token, admits waiting ones up to ``max_running``, holds KV blocks
as a real pool would (``ceil(tokens / block_size)`` per running sequence) and reports
telemetry, so ``/load`` and ``/metrics`` move as they would on a real replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from iterserve.config import EngineConfig, SchedulerConfig, ServerConfig
from iterserve.engine.limits import RequestLimits
from iterserve.engine.messages import (
    AddRequest,
    CompletionDelta,
    EngineDeadError,
    EngineLoad,
    IterationCallback,
    IterationStats,
    RequestAbortedError,
    RequestDelta,
    RequestFailedError,
)
from iterserve.engine.outputs import TokenLogprobs
from iterserve.server.app import build_app

# " the cat sat on a mat with big red hat and dog" in the default tokenizer (any ids below the
# vocabulary would do; these make readable text).
WORDS = [260, 2644, 2643, 335, 253, 1171, 351, 2066, 2382, 9968, 284, 2767]
NUM_KV_BLOCKS = 32  # 512 tokens: a prompt can be within max_model_len yet over the pool
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024


def fake_token(prompt_token_ids: list[int], index: int, position: int) -> int:
    """Output token ``position`` of completion ``index`` of a request with this prompt."""
    return WORDS[(sum(prompt_token_ids) + 7 * index + position) % len(WORDS)]


def fake_logprob(position: int) -> float:
    return -0.25 * (position + 1)


@dataclass
class _Completion:
    index: int
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Request:
    message: AddRequest
    stream: asyncio.Queue[RequestDelta | BaseException]
    completions: list[_Completion]
    running: bool = False
    first_scheduled_time: float | None = None

    @property
    def num_blocks(self) -> int:
        if not self.running:
            return 0
        prompt = len(self.message.prompt_token_ids)
        return sum(-(-(prompt + len(c.token_ids)) // BLOCK_SIZE) for c in self.completions)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class FakeEngineClient:
    """An engine client without a model (see the module docstring).

    Args:
        tokenizer: the tokenizer the server uses (token texts of the outputs).
        clock: the engine's clock (admission times).
        auto_step: step on its own task every ``step_interval_s`` while requests run.
        max_running: sequences admitted at once (the rest wait).
        swap_space: GiB of host swap the "engine" has (live ``swap`` needs some).
    """

    def __init__(
        self,
        tokenizer: Any,
        clock: Callable[[], float],
        auto_step: bool = True,
        step_interval_s: float = 0.0,
        max_running: int = 32,
        swap_space: float = 0.0,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self.auto_step = auto_step
        self.step_interval_s = step_interval_s
        self.max_running = max_running
        scheduler = scheduler or SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512)
        self.config = EngineConfig.from_kwargs(
            max_model_len=MAX_MODEL_LEN,
            num_kv_blocks=NUM_KV_BLOCKS,
            swap_space=swap_space,
            **{f.name: getattr(scheduler, f.name) for f in dataclasses.fields(scheduler)},
        )
        self.limits = RequestLimits(
            vocab_size=49152,
            max_model_len=MAX_MODEL_LEN,
            num_kv_blocks=NUM_KV_BLOCKS,
            block_size=BLOCK_SIZE,
            has_tokenizer=True,
            scheduler=self.config.scheduler,
        )
        self.model_dir: str | None = "fake"
        self.load = EngineLoad(num_free_blocks=NUM_KV_BLOCKS, num_total_blocks=NUM_KV_BLOCKS)
        self.on_iteration: IterationCallback | None = None
        self.added: list[AddRequest] = []  # every request the server queued, in order
        self.aborted: list[str] = []  # request ids aborted (disconnects, abort_all)
        self.config_updates: list[SchedulerConfig] = []
        self.fail_next_step = False  # the next step fails the running requests
        self._requests: dict[str, _Request] = {}
        self._running = False
        self._wake = asyncio.Event()
        self._stepper: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- EngineClient

    @property
    def is_running(self) -> bool:
        return self._running

    async def start(self) -> None:
        self._running = True
        if self.auto_step:
            self._stepper = asyncio.create_task(self._auto_step())

    async def stop(self) -> None:
        self.kill("the engine stopped")
        if self._stepper is not None:
            self._stepper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stepper

    async def generate(self, request: AddRequest) -> AsyncIterator[RequestDelta]:
        if not self._running:
            raise EngineDeadError("the engine is not running")
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        completions = [_Completion(i, request.params.max_tokens) for i in range(request.params.n)]
        state = _Request(request, asyncio.Queue(), completions)
        self._requests[request.request_id] = state
        self.added.append(request)
        self._publish()
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await state.stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if self._requests.pop(request.request_id, None) is not None and not finished:
                self.aborted.append(request.request_id)
            self._publish()

    def abort_all(self, reason: str) -> int:
        ids = list(self._requests)
        for request_id in ids:
            self._requests.pop(request_id).stream.put_nowait(RequestAbortedError(reason))
            self.aborted.append(request_id)
        self._publish()
        return len(ids)

    async def update_scheduler_config(self, config: SchedulerConfig) -> None:
        if not self._running:
            raise EngineDeadError("the engine is not running")
        self.config_updates.append(config)
        self.limits = dataclasses.replace(self.limits, scheduler=config)

    # ----------------------------------------------------------------- test controls

    def kill(self, reason: str = "the engine died") -> None:
        """The engine is gone: every stream ends with EngineDeadError."""
        self._running = False
        for state in self._requests.values():
            state.stream.put_nowait(EngineDeadError(reason))
        self._requests.clear()
        self._publish()

    @property
    def num_live(self) -> int:
        return len(self._requests)

    def step(self) -> None:
        """One iteration: admit waiting requests, give every running completion a token."""
        now = self.clock()
        waiting = [r for r in self._requests.values() if not r.running]
        num_running = sum(len(r.completions) for r in self._requests.values() if r.running)
        for r in waiting:
            if num_running + len(r.completions) > self.max_running:
                break
            r.running, r.first_scheduled_time = True, now
            num_running += len(r.completions)
        if self.fail_next_step:
            self.fail_next_step = False
            for request_id, r in list(self._requests.items()):
                if r.running:
                    r.stream.put_nowait(RequestFailedError("fake forward failed"))
                    del self._requests[request_id]
            self._publish()
            return
        num_tokens = 0
        for request_id, r in list(self._requests.items()):
            if not r.running:
                continue
            deltas = [self._advance(r, c) for c in r.completions if c.finish_reason is None]
            num_tokens += len(deltas)
            r.stream.put_nowait(
                RequestDelta(request_id, deltas, r.finished, 0, r.first_scheduled_time)
            )
            if r.finished:  # its blocks are free at once, as the engine frees them
                del self._requests[request_id]
        self._publish(num_tokens)

    def _advance(self, r: _Request, c: _Completion) -> CompletionDelta:
        position = len(c.token_ids)
        token_id = fake_token(r.message.prompt_token_ids, c.index, position)
        c.token_ids.append(token_id)
        if len(c.token_ids) >= c.max_tokens:
            c.finish_reason = "length"
        logprobs = None
        if r.message.params.logprobs is not None:
            top = [(token_id, fake_logprob(position))][: r.message.params.logprobs]
            logprobs = [TokenLogprobs(token_id, fake_logprob(position), top)]
        text = str(self.tokenizer.decode([token_id]))
        return CompletionDelta(c.index, [token_id], text, logprobs, c.finish_reason)

    def _publish(self, num_tokens: int = 0) -> None:
        running = [r for r in self._requests.values() if r.running]
        num_used = sum(r.num_blocks for r in running)
        self.load = EngineLoad(
            kv_cache_usage=num_used / NUM_KV_BLOCKS,
            num_running=sum(len(r.completions) for r in running),
            num_waiting=sum(len(r.completions) for r in self._requests.values() if not r.running),
            num_free_blocks=NUM_KV_BLOCKS - num_used,
            num_total_blocks=NUM_KV_BLOCKS,
        )
        telemetry = []
        if num_tokens:
            telemetry.append(
                IterationStats(
                    time=self.clock(),
                    latency_s=0.001,
                    num_prefill_tokens=0,
                    num_decode_tokens=num_tokens,
                    num_running=self.load.num_running,
                    num_waiting=self.load.num_waiting,
                    num_swapped=0,
                    num_free_blocks=self.load.num_free_blocks,
                    num_preemptions=0,
                    num_generated_tokens=num_tokens,
                )
            )
        if self.on_iteration is not None:
            self.on_iteration(telemetry, self.load)

    async def _auto_step(self) -> None:
        while True:
            if not any(True for _ in self._requests):
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.step_interval_s)
            if self._running:
                self.step()


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``condition()`` every event-loop turn until true; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.001)


def expected_text(tokenizer: Any, prompt_token_ids: list[int], index: int, num: int) -> str:
    """The text of the first ``num`` tokens of completion ``index`` (see :func:`fake_token`)."""
    return "".join(
        str(tokenizer.decode([fake_token(prompt_token_ids, index, k)])) for k in range(num)
    )


def run_with_server(
    tokenizer: Any,
    test: Callable[[httpx.AsyncClient, FakeEngineClient], Awaitable[None]],
    server_config: ServerConfig | None = None,
    clock: Callable[[], float] | None = None,
    **fake_kwargs: Any,
) -> FakeEngineClient:
    """Run ``test(http, fake)`` against an in-process server over a fake engine; the fake."""
    clock = clock or time.monotonic
    fake = FakeEngineClient(tokenizer, clock, **fake_kwargs)

    async def main() -> None:
        async with (
            serve_in_process(fake, server_config, clock=clock) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            await test(http, fake)

    asyncio.run(main())
    return fake


@contextlib.asynccontextmanager
async def serve_in_process(
    engine: Any,
    server_config: ServerConfig | None = None,
    make_server: Callable[[uvicorn.Config, Any], uvicorn.Server] | None = None,
    send_buffer_bytes: int | None = None,
    **app_kwargs: Any,
) -> AsyncIterator[str]:
    """``build_app(engine)`` under uvicorn on a loopback port of this event loop; its URL.

    ``make_server(config, app)`` builds the uvicorn server (default: a plain one).
    ``send_buffer_bytes`` fixes the kernel's send buffer of every connection (SO_SNDBUF;
    default: Linux grows it up to ``tcp_wmem``, 4 MiB, before a stalled client blocks a send).
    """
    app = build_app(engine, server_config, tokenizer=engine.tokenizer, **app_kwargs)
    sock = socket.socket()
    if send_buffer_bytes is not None:  # accepted sockets inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on")
    server = make_server(config, app) if make_server else uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(1000):
            if server.started or task.done():
                break
            await asyncio.sleep(0.005)
        if not server.started:
            raise RuntimeError("the in-process server did not start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()
