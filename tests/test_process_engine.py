"""The engine loop in its own process (ProcessEngine), on the real default model (float32)."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import time
from typing import Any

import pytest
from helpers import collect, make_engine

from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.llm_engine import IterationError
from iterserve.engine.messages import (
    AddRequest,
    EngineDeadError,
    EngineStartError,
    RequestFailedError,
)
from iterserve.engine.process_engine import ProcessEngine
from iterserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
KWARGS = {"dtype": "float32", "num_kv_blocks": 64}


def prompts(loaded: Any) -> list[list[int]]:
    texts = ["The sky is", "def add(a, b):", "Three colours:", "Paris is"]
    return [list(loaded.tokenizer(t).input_ids) for t in texts]


@pytest.mark.model
def test_streams_and_aborts_across_the_process_boundary(loaded_f32: Any) -> None:
    expected = {}
    sync = make_engine(loaded_f32)
    for i, p in enumerate(prompts(loaded_f32)):
        sync.add_request(str(i), p, GREEDY)
    while sync.has_unfinished_requests():
        for out in sync.step():
            if out.finished:
                expected[out.request_id] = out.outputs[0]

    async def main() -> None:
        engine = ProcessEngine(KWARGS)
        await engine.start()
        assert engine.config.model.max_model_len == loaded_f32.config.model.max_model_len
        assert engine.limits.num_kv_blocks == 64
        try:
            # Concurrent streams give the same greedy tokens and text as the in-process engine.
            results = await asyncio.gather(
                *[collect(engine, str(i), p, GREEDY) for i, p in enumerate(prompts(loaded_f32))]
            )
            for i, (_, out) in enumerate(results):
                want = expected[str(i)]
                assert out.finished
                assert (out.outputs[0].token_ids, out.outputs[0].text) == (
                    want.token_ids,
                    want.text,
                )
            # Leaving a stream aborts the request: all blocks free after the next boundary.
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            request = AddRequest("gone", prompts(loaded_f32)[0], long, 1, time.monotonic())
            stream = engine.generate(request)
            async for delta in stream:
                if delta.completions[0].new_token_ids and engine.load.num_running:
                    break
            await stream.aclose()
            load = await engine.query_load()
            assert load.num_free_blocks == load.num_total_blocks
            assert load.num_running == load.num_waiting == 0
        finally:
            await engine.stop()
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", prompts(loaded_f32)[0], GREEDY)
        with pytest.raises(EngineDeadError):
            await engine.query_load()

    asyncio.run(main())


@pytest.mark.model
def test_a_dying_engine_process_ends_every_stream(loaded_f32: Any) -> None:
    async def main() -> None:
        engine = ProcessEngine(KWARGS)
        await engine.start()
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        stream = engine.generate(AddRequest("doomed", prompts(loaded_f32)[0], long, 1, 0.0))
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


def test_errors_survive_the_pipe_with_their_fields() -> None:
    err = pickle.loads(pickle.dumps(InvalidRequestError("bad", "top_p")))
    assert (str(err), err.param) == ("bad", "top_p")
    it = pickle.loads(pickle.dumps(IterationError(["a"], ValueError("x"))))
    assert it.request_ids == ["a"] and "x" in str(it)


@pytest.mark.parametrize("bad_settings", [True, False])
def test_a_build_error_reaches_the_server_as_one_line(bad_settings: bool) -> None:
    """The child's build raising is an EngineStartError with its message (not an EOF)."""

    async def main() -> None:
        engine = ProcessEngine(
            {"bad_settings": bad_settings}, factory="engine_fakes:build_failing_engine"
        )
        with pytest.raises(EngineStartError) as caught:
            await engine.start()
        assert caught.value.bad_settings is bad_settings
        expected = "does not divide" if bad_settings else "RuntimeError: a loader bug"
        assert expected in str(caught.value)
        assert not engine.is_running
        assert engine._proc.exitcode == (2 if bad_settings else 1)

    asyncio.run(main())


def test_reused_ids_errors_outside_the_forward_and_stopping_twice() -> None:
    """On the fake runner's engine in a child process (engine_fakes.build_fragile_engine)."""
    from engine_fakes import BOMB_PROMPT

    async def main() -> None:
        engine = ProcessEngine({}, factory="engine_fakes:build_fragile_engine")
        with pytest.raises(EngineDeadError):
            await engine.query_load()  # never started
        await engine.start()
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            with pytest.raises(RequestFailedError, match="internal engine error"):
                await collect(engine, "bomb", BOMB_PROMPT, params)
            long = SamplingParams(max_tokens=50, ignore_eos=True)
            stream = engine.generate(AddRequest("re", [2, 3, 4], long, 1, 0.0))
            await stream.__anext__()
            with pytest.raises(ValueError, match="in use"):  # while it is live
                await collect(engine, "re", [2, 3, 4], params)
            await stream.aclose()
            # The same id again right away: only the new request's deltas arrive.
            deltas, out = await collect(engine, "re", [9, 9, 9], params)
            assert [len(d.completions[0].new_token_ids) for d in deltas] == [1, 1, 1, 1]
            assert all(d.request_id == "re" for d in deltas)
            assert out.finished and len(out.outputs[0].token_ids) == 4
            assert engine.is_running
        finally:
            await engine.stop()
        await engine.stop()  # idempotent

    asyncio.run(main())


_OWNER = """
import asyncio
from iterserve.engine.messages import AddRequest
from iterserve.engine.process_engine import ProcessEngine
from iterserve.engine.sampling_params import SamplingParams

async def main():
    engine = ProcessEngine({}, factory="engine_fakes:build_stalling_engine")
    await engine.start()
    print(engine.pid, flush=True)
    request = AddRequest("r", [2, 3, 4], SamplingParams(max_tokens=4), 1, 0.0)
    async for _ in engine.generate(request):
        pass

asyncio.run(main())
"""


def test_the_engine_process_dies_with_its_server_even_mid_iteration() -> None:
    """The server SIGKILLed while its engine child is inside a 60 s iteration (a long forward,
    a hung device): the child and the multiprocessing resource tracker are gone at once, not
    when the iteration ends."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    tests_dir = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests_dir, *sys.path])}
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert owner.stdout is not None
        engine_pid = int(owner.stdout.readline())
        assert owner.stdout.readline().strip() == "stalling"  # the child is in its iteration
        tree = psutil.Process(owner.pid).children()
        assert engine_pid in [p.pid for p in tree]
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        _, alive = psutil.wait_procs(tree, timeout=5)
        assert alive == []
    finally:
        owner.kill()
        owner.wait()


def test_a_hung_engine_process_is_killed_and_its_requests_fail() -> None:
    """An iteration that never ends (engine_fakes.build_stalling_engine: 60 s) and an idle
    engine that stops answering (SIGSTOP): the watchdog kills the child after
    ``hang_timeout_s`` of silence, so streams end with an error naming the hang and the
    client reports not running (the server then exits 1 and Kubernetes restarts the pod)."""
    import os
    import signal
    import time

    async def main() -> None:
        engine = ProcessEngine({}, factory="engine_fakes:build_stalling_engine", hang_timeout_s=2.0)
        await engine.start()
        start = time.monotonic()
        request = AddRequest("r", [2, 3, 4], SamplingParams(max_tokens=4), 1, 0.0)
        with pytest.raises(EngineDeadError, match="hung: nothing sent for 2 s"):
            async for _ in engine.generate(request):
                pass
        assert 2.0 <= time.monotonic() - start < 10
        assert not engine.is_running
        await engine.stop()

        idle = ProcessEngine({}, factory="engine_fakes:build_fragile_engine", hang_timeout_s=2.0)
        await idle.start()
        try:
            await asyncio.sleep(2.5)  # idle past the timeout: the probes are answered
            assert idle.is_running
            assert idle.pid is not None
            os.kill(idle.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while idle.is_running:
                assert time.monotonic() < deadline, "a stopped engine was never declared hung"
                await asyncio.sleep(0.1)
            with pytest.raises(EngineDeadError):
                await idle.query_load()
        finally:
            await idle.stop()

    asyncio.run(main())
