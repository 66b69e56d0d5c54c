"""The engine loop in its own process, on the real default model (float32)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from helpers import make_engine

from iterserve.engine.async_engine import EngineDeadError
from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.process_engine import ProcessEngine
from iterserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
KWARGS = {"dtype": "float32", "num_kv_blocks": 64}


def prompts(loaded: Any) -> list[list[int]]:
    texts = ["The sky is", "def add(a, b):", "Three colours:", "Paris is"]
    return [list(loaded.tokenizer(t).input_ids) for t in texts]


async def collect(engine: ProcessEngine, request_id: str, prompt: list[int]) -> list[RequestOutput]:
    return [out async for out in engine.generate(request_id, prompt, GREEDY)]


def test_streams_aborts_and_errors(loaded_f32: Any) -> None:
    expected = {}
    sync = make_engine(loaded_f32)
    for i, p in enumerate(prompts(loaded_f32)):
        sync.add_request(str(i), p, GREEDY)
    while sync.has_unfinished_requests():
        for out in sync.step():
            if out.finished:
                expected[out.request_id] = out.outputs[0].token_ids

    async def main() -> None:
        engine = ProcessEngine(KWARGS)
        await engine.start()
        try:
            # Concurrent streams give the same greedy tokens as the in-process engine.
            results = await asyncio.gather(
                *[collect(engine, str(i), p) for i, p in enumerate(prompts(loaded_f32))]
            )
            for i, outs in enumerate(results):
                assert outs[-1].finished
                assert outs[-1].outputs[0].token_ids == expected[str(i)]
            # Invalid requests are refused here, before anything reaches the child.
            with pytest.raises(InvalidRequestError):
                await collect(engine, "empty", [])
            with pytest.raises(InvalidRequestError, match="tier"):
                await collect_priority(engine, "gold")
            # Leaving a stream aborts the request: all blocks free after the next boundary.
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = engine.generate("gone", prompts(loaded_f32)[0], long)
            async for out in stream:
                if len(out.outputs[0].token_ids) == 3:
                    break
            await stream.aclose()
            stats = await engine.call("stats")
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
            assert stats["num_running"] == stats["num_waiting"] == 0
        finally:
            await engine.stop()
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", prompts(loaded_f32)[0])
        with pytest.raises(EngineDeadError):
            await engine.call("stats")

    asyncio.run(main())


async def collect_priority(engine: ProcessEngine, priority: str) -> list[RequestOutput]:
    return [out async for out in engine.generate("p", [1, 2, 3], GREEDY, priority=priority)]


def test_a_dying_engine_process_ends_every_stream(loaded_f32: Any) -> None:
    async def main() -> None:
        engine = ProcessEngine(KWARGS)
        await engine.start()
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        stream = engine.generate("doomed", prompts(loaded_f32)[0], long)
        await stream.__anext__()
        engine._proc.kill()  # the child crashes (OOM killer, segfault...)

        async def drain() -> None:
            async for _ in stream:
                pass

        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(drain(), timeout=60)
        with contextlib.suppress(EngineDeadError):
            await engine.stop()
        assert not engine.is_running

    asyncio.run(main())


def test_reused_ids_stop_twice_and_pickled_errors(loaded_f32: Any) -> None:
    import pickle

    from iterserve.engine.llm_engine import IterationError

    # Our exceptions survive the pipe with their fields.
    err = pickle.loads(pickle.dumps(InvalidRequestError("bad", "top_p")))
    assert (str(err), err.param) == ("bad", "top_p")
    it = pickle.loads(pickle.dumps(IterationError(["a"], ValueError("x"))))
    assert it.request_ids == ["a"] and "x" in str(it)

    async def main() -> None:
        engine = ProcessEngine(KWARGS)
        with pytest.raises(EngineDeadError):
            await engine.call("stats")  # never started
        await engine.start()
        try:
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = engine.generate("re", prompts(loaded_f32)[0], long)
            async for out in stream:
                if len(out.outputs[0].token_ids) == 5:
                    break
            await stream.aclose()
            # The same id again right away: only the new request's outputs arrive.
            short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            outs = [o async for o in engine.generate("re", [9, 9, 9], short)]
            assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
            assert all(o.request_id == "re" and o.prompt_token_ids == [9, 9, 9] for o in outs)
        finally:
            await engine.stop()
        await engine.stop()  # idempotent

    asyncio.run(main())


def test_an_error_outside_the_forward_fails_requests_not_the_engine() -> None:
    from engine_fakes import BOMB_PROMPT

    from iterserve.engine.async_engine import RequestFailedError

    async def main() -> None:
        engine = ProcessEngine({}, factory="engine_fakes:build_fragile_engine")
        await engine.start()
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            with pytest.raises(RequestFailedError, match="internal engine error"):
                async for _ in engine.generate("bomb", BOMB_PROMPT, params):
                    pass
            outs = [out async for out in engine.generate("fine", [2, 3, 4], params)]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
            assert engine.is_running
        finally:
            await engine.stop()

    asyncio.run(main())
