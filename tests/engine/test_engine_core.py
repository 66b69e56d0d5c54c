"""The engine loop and its messages, on the fake runner: deltas, commands, failures, clock."""

from __future__ import annotations

import ast
import pickle
from collections import deque
from pathlib import Path
from typing import Any

from engine_fakes import FakeClock, FakeRunner, Harness, expected_output, prompt

import iterserve.engine
from iterserve.config import SchedulerConfig
from iterserve.engine.engine_core import EngineCore
from iterserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CallResult,
    EngineCommand,
    EngineLoad,
    EngineMessage,
    EngineReady,
    QueryLoad,
    RequestFailedError,
    Shutdown,
    StepResult,
    UpdateSchedulerConfig,
)
from iterserve.engine.sampling_params import SamplingParams


def run_core(h: Harness, commands: list[EngineCommand]) -> list[EngineMessage]:
    """Feed ``commands`` to an EngineCore over ``h``'s engine; it runs until all requests
    finished and the commands are spent, then shuts down. Every message it sent."""
    sent: list[EngineMessage] = []
    pending = deque(commands)

    def recv(block: bool) -> EngineCommand | None:
        if pending:
            return pending.popleft()
        return Shutdown() if block else None

    EngineCore(h.engine, sent.append).run(recv)
    return sent


def add(request_id: str, n_prompt: int, max_tokens: int, n: int = 1, **kw: Any) -> AddRequest:
    params = SamplingParams(max_tokens=max_tokens, n=n, **kw)
    return AddRequest(request_id, prompt(n_prompt), params, 1, 0.0)


def steps(sent: list[EngineMessage]) -> list[StepResult]:
    return [m for m in sent if isinstance(m, StepResult)]


def test_deltas_carry_only_the_new_tokens_of_each_completion() -> None:
    h = Harness(max_num_batched_tokens=16)
    sent = run_core(h, [add("a", 5, 6), add("b", 3, 4, n=2)])
    assert isinstance(sent[0], EngineReady)
    tokens: dict[tuple[str, int], list[int]] = {}
    finish: dict[tuple[str, int], str | None] = {}
    for result in steps(sent):
        for delta in result.outputs:
            for c in delta.completions:
                assert len(c.new_token_ids) == 1  # one token per iteration, never repeated
                tokens.setdefault((delta.request_id, c.index), []).extend(c.new_token_ids)
                finish[(delta.request_id, c.index)] = c.finish_reason
    assert tokens == {
        ("a", 0): expected_output("a", 5, 6),
        ("b", 0): expected_output("b#0", 3, 4),
        ("b", 1): expected_output("b#1", 3, 4),
    }
    assert set(finish.values()) == {"length"}
    finals = [d for r in steps(sent) for d in r.outputs if d.finished]
    assert sorted(d.request_id for d in finals) == ["a", "b"]


def test_bytes_per_iteration_do_not_grow_with_the_output() -> None:
    h = Harness(max_model_len=600, num_kv_blocks=200)
    sent = run_core(h, [add("long", 4, 500)])
    sizes = [len(pickle.dumps(r)) for r in steps(sent) if r.outputs]
    assert len(sizes) == 500
    # The first delta carries the admission time; later ones differ only by the token's
    # pickled width and the telemetry's counters.
    assert max(sizes[1:]) - min(sizes[1:]) <= 16, (min(sizes[1:]), max(sizes[1:]))


def test_an_id_in_use_fails_only_that_add() -> None:
    h = Harness()
    sent = run_core(h, [add("a", 3, 4), add("a", 3, 2)])
    errors = [e for r in steps(sent) for e in r.errors]
    assert [(e.request_id, type(e.error)) for e in errors] == [("a", ValueError)]
    tokens = [
        t for r in steps(sent) for d in r.outputs for c in d.completions for t in c.new_token_ids
    ]
    assert tokens == expected_output("a", 3, 4)


def test_calls_are_answered_and_an_idle_abort_reports_the_new_load() -> None:
    h = Harness(num_kv_blocks=16)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32)
    sent: list[EngineMessage] = []
    commands: deque[EngineCommand] = deque(
        [add("a", 9, 40), UpdateSchedulerConfig(7, config), QueryLoad(8)]
    )
    core = EngineCore(h.engine, sent.append)
    for command in commands:
        core.apply(command)
    core.step()
    assert [m for m in sent if isinstance(m, CallResult)] == [
        CallResult(7),
        CallResult(8, EngineLoad(0.0, 0, 1, 0, 16, 0, 16)),
    ]
    assert h.scheduler.config == config
    load = steps(sent)[-1].load
    assert load.num_running == 1 and load.num_free_blocks == 16 - 3
    core.apply(AbortRequests(["a"]))
    assert h.kv.pool.num_free_blocks == 16  # at once, before any step
    core._send_result([])
    assert steps(sent)[-1].load.num_free_blocks == 16


def test_a_failed_forward_fails_its_requests_and_the_loop_goes_on() -> None:
    class Faulty(FakeRunner):
        def execute_model(self, scheduler_output: Any) -> Any:
            if len(self.outputs) == 1:
                self.outputs.append(scheduler_output)
                raise RuntimeError("injected")
            return super().execute_model(scheduler_output)

    h = Harness(Faulty())
    sent = run_core(h, [add("a", 3, 5)])
    errors = [e for r in steps(sent) for e in r.errors]
    assert [e.request_id for e in errors] == ["a"]
    assert isinstance(errors[0].error, RequestFailedError)
    assert "RuntimeError: injected" in str(errors[0].error)
    assert h.kv.pool.num_free_blocks == h.kv.num_blocks
    sent = run_core(h, [add("b", 3, 2)])  # the same engine serves the next request
    assert [d.finished for r in steps(sent) for d in r.outputs] == [False, True]


def test_shutdown_aborts_everything() -> None:
    h = Harness()
    core = EngineCore(h.engine, lambda m: None)
    core.apply(add("a", 3, 40))
    core.step()
    assert core.apply(Shutdown()) is False
    assert not h.engine.has_unfinished_requests()
    assert h.kv.pool.num_free_blocks == h.kv.num_blocks


def test_the_engine_runs_on_its_injected_clock() -> None:
    clock = FakeClock(100.0)
    h = Harness(clock=clock)
    h.engine.add_request("a", prompt(3), SamplingParams(max_tokens=2))
    clock.now += 2.0
    (out,) = h.engine.step()
    assert out.arrival_time == 100.0 and out.first_scheduled_time == 102.0
    record = h.engine.telemetry[-1]
    assert record.time == 102.0 and record.latency_s == 0.0


def test_the_engine_reads_no_clock_of_its_own() -> None:
    """Only the injected clock: no time.monotonic(), perf_counter() or time() calls."""
    calls = []
    for path in Path(iterserve.engine.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "time"
            ):
                calls.append(f"{path.name}:{node.lineno} time.{node.func.attr}()")
    assert calls == []
