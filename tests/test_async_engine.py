"""The engine loop on a thread (AsyncEngine) on the real default model: streams, aborts,
failures."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from helpers import collect, make_engine

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.messages import AddRequest, EngineDeadError, RequestFailedError
from iterserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def prompts(loaded: Any) -> list[list[int]]:
    texts = ["The sky is", "def add(a, b):", "Three colours:", "Paris is", "Water boils at"]
    return [list(loaded.tokenizer(t).input_ids) for t in texts]


def test_concurrent_streams_match_the_sync_engine(loaded_f32: Any) -> None:
    expected = {}
    engine = make_engine(loaded_f32)
    for i, p in enumerate(prompts(loaded_f32)):
        engine.add_request(str(i), p, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                expected[out.request_id] = out.outputs[0]

    async def main() -> list[Any]:
        aengine = AsyncEngine(make_engine(loaded_f32, max_num_batched_tokens=32, max_num_seqs=8))
        await aengine.start()
        try:
            tasks = [collect(aengine, str(i), p, GREEDY) for i, p in enumerate(prompts(loaded_f32))]
            results = await asyncio.gather(*tasks)
        finally:
            await aengine.stop()
        assert len(aengine.engine.telemetry) > 0
        return results

    for i, (deltas, out) in enumerate(asyncio.run(main())):
        want = expected[str(i)]
        assert out.finished and (out.outputs[0].token_ids, out.outputs[0].text) == (
            want.token_ids,
            want.text,
        )
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        # One delta per new token, carrying only that token: the stream is incremental.
        assert [len(d.completions[0].new_token_ids) for d in deltas] == [1] * len(deltas)


def test_leaving_a_stream_aborts_and_frees_blocks_by_the_next_iteration(loaded_f32: Any) -> None:
    async def main() -> None:
        engine = make_engine(loaded_f32)
        aengine = AsyncEngine(engine)
        await aengine.start()
        try:
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            prompt = prompts(loaded_f32)[0] * 20
            stream = aengine.generate(AddRequest("gone", prompt, long, 1, time.monotonic()))
            num_tokens = 0
            async for delta in stream:
                num_tokens += len(delta.completions[0].new_token_ids)
                if num_tokens == 3:
                    break
            await stream.aclose()  # what a client disconnect does to the handler
            load = await aengine.query_load()  # one iteration boundary later
            assert load.num_free_blocks == load.num_total_blocks and load.num_running == 0
            assert not engine.has_unfinished_requests()
            # The engine keeps serving.
            _, out = await collect(aengine, "next", prompts(loaded_f32)[1], GREEDY)
            assert out.finished
        finally:
            await aengine.stop()

    asyncio.run(main())


def test_a_failed_iteration_fails_only_its_requests(loaded_f32: Any) -> None:
    async def main() -> None:
        # One running slot: the second request waits while the first's iteration fails.
        engine = make_engine(loaded_f32, max_num_seqs=1, max_num_batched_tokens=64)
        aengine = AsyncEngine(engine)
        await aengine.start()
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
            first = asyncio.ensure_future(collect(aengine, "first", prompts(loaded_f32)[0], GREEDY))
            await asyncio.sleep(0)
            second = asyncio.ensure_future(
                collect(aengine, "second", prompts(loaded_f32)[1], GREEDY)
            )
            with pytest.raises(RequestFailedError, match="injected fault"):
                await first
            _, out = await second
            assert out.outputs[0].finish_reason in ("stop", "length")
            load = await aengine.query_load()
            assert load.num_free_blocks == load.num_total_blocks
        finally:
            runner.execute_model = original  # type: ignore[method-assign]
            await aengine.stop()

    asyncio.run(main())


def test_commands_racing_stop_never_hang(loaded_f32: Any) -> None:
    async def main() -> None:
        for _ in range(10):
            aengine = AsyncEngine(make_engine(loaded_f32))
            await aengine.start()
            long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
            request = AddRequest("long", prompts(loaded_f32)[0], long, 1, time.monotonic())
            stream = aengine.generate(request)
            await stream.__anext__()
            stopping = asyncio.ensure_future(aengine.stop())
            await asyncio.sleep(0)
            with contextlib.suppress(EngineDeadError):  # it may still run, or be refused
                await asyncio.wait_for(aengine.query_load(), timeout=30)

            async def drain(stream: Any = stream) -> None:
                async for _ in stream:
                    pass

            with pytest.raises(EngineDeadError):  # the stream ends with the error, no hang
                await asyncio.wait_for(drain(), timeout=30)
            await stopping
            with pytest.raises(EngineDeadError):
                await aengine.query_load()

    asyncio.run(main())
