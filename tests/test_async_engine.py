"""The asyncio engine client on the real default model: streams, aborts, failures."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from helpers import make_engine

from iterserve.engine.async_engine import AsyncEngine, RequestFailedError
from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def prompts(loaded: Any) -> list[list[int]]:
    texts = ["The sky is", "def add(a, b):", "Three colours:", "Paris is", "Water boils at"]
    return [list(loaded.tokenizer(t).input_ids) for t in texts]


async def collect(aengine: AsyncEngine, request_id: str, prompt: list[int]) -> list[RequestOutput]:
    return [out async for out in aengine.generate(request_id, prompt, GREEDY)]


def test_concurrent_streams_match_the_sync_engine(loaded_f32: Any) -> None:
    expected = {}
    engine = make_engine(loaded_f32)
    for i, p in enumerate(prompts(loaded_f32)):
        engine.add_request(str(i), p, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                expected[out.request_id] = out.outputs[0].token_ids

    async def main() -> dict[str, list[RequestOutput]]:
        aengine = AsyncEngine(make_engine(loaded_f32, max_num_batched_tokens=32, max_num_seqs=8))
        aengine.start()
        try:
            tasks = [collect(aengine, str(i), p) for i, p in enumerate(prompts(loaded_f32))]
            results = await asyncio.gather(*tasks)
        finally:
            await aengine.stop()
        assert len(aengine.engine.telemetry) > 0
        return {str(i): r for i, r in enumerate(results)}

    streams = asyncio.run(main())
    for request_id, outs in streams.items():
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].token_ids == expected[request_id]
        # One output per new token: the stream is incremental.
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, len(outs) + 1))


def test_leaving_a_stream_aborts_and_frees_blocks_by_the_next_iteration(loaded_f32: Any) -> None:
    async def main() -> None:
        engine = make_engine(loaded_f32)
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            prompt = prompts(loaded_f32)[0] * 20
            stream = aengine.generate("gone", prompt, long)
            async for out in stream:
                if len(out.outputs[0].token_ids) == 3:
                    break
            await stream.aclose()  # what a client disconnect does to the handler
            await aengine.call(lambda: None)  # one iteration boundary later
            kv = engine.scheduler.kv
            assert kv.pool.num_free_blocks == kv.num_blocks
            assert not engine.has_unfinished_requests()
            # The engine keeps serving.
            outs = await collect(aengine, "next", prompts(loaded_f32)[1])
            assert outs[-1].finished
        finally:
            await aengine.stop()

    asyncio.run(main())


def test_bad_requests_fail_alone(loaded_f32: Any) -> None:
    async def main() -> None:
        engine = make_engine(loaded_f32)
        aengine = AsyncEngine(engine)
        aengine.start()
        runner = engine.runner
        try:
            with pytest.raises(InvalidRequestError):
                await collect(aengine, "empty", [])
            # An iteration that raises fails the requests it carried, not the engine.
            original = runner.execute_model

            def broken(*args: Any) -> Any:
                runner.execute_model = original  # type: ignore[method-assign]
                raise RuntimeError("injected fault")

            runner.execute_model = broken  # type: ignore[method-assign]
            with pytest.raises(RequestFailedError, match="injected fault"):
                await collect(aengine, "unlucky", prompts(loaded_f32)[2])
            outs = await collect(aengine, "fine", prompts(loaded_f32)[3])
            assert outs[-1].outputs[0].finish_reason in ("stop", "length")
            kv = engine.scheduler.kv
            await aengine.call(lambda: None)
            assert kv.pool.num_free_blocks == kv.num_blocks
        finally:
            await aengine.stop()

    asyncio.run(main())


def test_a_failed_iteration_fails_only_its_requests(loaded_f32: Any) -> None:
    async def main() -> None:
        # One running slot: the second request waits while the first's iteration fails.
        engine = make_engine(loaded_f32, max_num_seqs=1, max_num_batched_tokens=64)
        aengine = AsyncEngine(engine)
        aengine.start()
        runner = engine.runner
        original = runner.execute_model
        calls = 0

        def fail_second_call(*args: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("injected fault")
            return original(*args)

        runner.execute_model = fail_second_call  # type: ignore[method-assign]
        try:
            first = asyncio.ensure_future(collect(aengine, "first", prompts(loaded_f32)[0]))
            await asyncio.sleep(0)
            second = asyncio.ensure_future(collect(aengine, "second", prompts(loaded_f32)[1]))
            with pytest.raises(RequestFailedError, match="injected fault"):
                await first
            outs = await second
            assert outs[-1].outputs[0].finish_reason in ("stop", "length")
        finally:
            runner.execute_model = original  # type: ignore[method-assign]
            await aengine.stop()

    asyncio.run(main())


def test_commands_racing_stop_never_hang(loaded_f32: Any) -> None:
    from iterserve.engine.async_engine import EngineDeadError

    async def main() -> None:
        for _ in range(10):
            aengine = AsyncEngine(make_engine(loaded_f32))
            aengine.start()
            long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
            stream = aengine.generate("long", prompts(loaded_f32)[0], long)
            await stream.__anext__()
            stopping = asyncio.ensure_future(aengine.stop())
            await asyncio.sleep(0)
            with contextlib.suppress(EngineDeadError):  # it may still run, or be refused
                await asyncio.wait_for(aengine.call(lambda: 1), timeout=30)

            async def drain(stream: Any = stream) -> None:
                async for _ in stream:
                    pass

            with pytest.raises(EngineDeadError):  # the stream ends with the error, no hang
                await asyncio.wait_for(drain(), timeout=30)
            await stopping
            with pytest.raises(EngineDeadError):
                await aengine.call(lambda: 1)

    asyncio.run(main())
