"""Fakes and harnesses shared by the engine tests (importable as ``engine_fakes``).

Sampled tokens depend only on ``(request_id, position)``, so every request's output is known
in advance whatever the schedule. :class:`FakeRunner` records batches; :class:`KVSimRunner`
also simulates the KV cache (device pool, and a host pool for swapping when it has one) and
checks every context read. :class:`Harness` is an :class:`LLMEngine` on either of them that
checks integrity after every step.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from iterserve.config import EngineConfig
from iterserve.engine.factory import ModelInfo, build_engine
from iterserve.engine.kv_cache_manager import cdiv
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.messages import monotonic_clock
from iterserve.engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from iterserve.engine.policy import PreemptionCosts
from iterserve.engine.request import Request, RequestStatus
from iterserve.engine.sampling_params import SamplingParams

VOCAB_SIZE = 32
EOS = 1

# (request_id, num_computed_tokens, num_scheduled_tokens, sample) of one ScheduledRequest.
Row = tuple[str, int, int, bool]

Sampler = Callable[[str, int], int]


def token_for(request_id: str, position: int) -> int:
    """The token the fake model samples at ``position`` of a request: never EOS, never 0."""
    return 2 + zlib.crc32(f"{request_id}:{position}".encode()) % (VOCAB_SIZE - 2)


def random_token(request_id: str, position: int, vocab_size: int = VOCAB_SIZE) -> int:
    """The token sampled at ``position``: EOS about one time in 13, else a non-EOS id."""
    h = zlib.crc32(f"{request_id}@{position}".encode())
    return EOS if h % 13 == 0 else 2 + h % (vocab_size - 2)


def expected_output(request_id: str, num_prompt_tokens: int, num_output_tokens: int) -> list[int]:
    """The ``token_for`` outputs of a request that finishes by length."""
    start = num_prompt_tokens
    return [token_for(request_id, p) for p in range(start, start + num_output_tokens)]


def prompt(n: int, first: int = 2) -> list[int]:
    return [(first + i) % VOCAB_SIZE for i in range(n)]


def completion(out: RequestOutput) -> tuple[list[int], str | None]:
    (c,) = out.outputs
    return c.token_ids, c.finish_reason


class FakeClock:
    """Seconds that only move when a test says so."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------- runners


class FakeRunner:
    """Records every batch and samples ``token_for(request_id, position)``."""

    def __init__(self, eos_at: dict[str, int] | None = None) -> None:
        self.outputs: list[SchedulerOutput] = []
        self.eos_at = eos_at or {}  # request_id -> position where EOS is sampled

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.outputs.append(scheduler_output)
        sampled = {}
        for sched in scheduler_output.scheduled:
            if sched.sample:
                position = sched.seq_len
                eos = self.eos_at.get(sched.request_id) == position
                sampled[sched.request_id] = EOS if eos else token_for(sched.request_id, position)
        return ModelRunnerOutput(sampled_token_ids=sampled)


class KVSimRunner:
    """A model runner whose device (and host, if any) KV caches are ``slot -> token id`` maps.

    Each iteration it makes the copies of ``blocks_to_swap_out`` (device -> host), then those
    of ``blocks_to_swap_in`` (host -> device), then writes this iteration's tokens, and
    finally checks that every context position of every scheduled request reads its true
    token. ``strict`` also checks that a block table never repeats a block and that exactly
    the requests whose chunk reaches their last token sample.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        lookup: Callable[[str], Request],
        sample: Sampler = token_for,
        num_host_blocks: int = 0,
        strict: bool = False,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.lookup = lookup
        self.sample = sample
        self.strict = strict
        self.device: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self.outputs: list[SchedulerOutput] = []

    @property
    def reported_finished(self) -> list[str]:
        """Every finished request id the scheduler has reported, in order."""
        return [rid for out in self.outputs for rid in out.finished_request_ids]

    def slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def _copy_block(
        self, src: dict[int, int], src_block: int, dst: dict[int, int], dst_block: int
    ) -> None:
        bs = self.block_size
        for offset in range(bs):
            value = src.get(src_block * bs + offset)
            if value is None:
                dst.pop(dst_block * bs + offset, None)
            else:
                dst[dst_block * bs + offset] = value

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.outputs.append(scheduler_output)
        out_pairs = scheduler_output.blocks_to_swap_out
        in_pairs = scheduler_output.blocks_to_swap_in
        assert len({h for _, h in out_pairs}) == len(out_pairs), out_pairs
        assert len({d for _, d in in_pairs}) == len(in_pairs), in_pairs
        for device_block, host_block in out_pairs:
            assert 0 <= device_block < self.num_blocks and 0 <= host_block < self.num_host_blocks
            self._copy_block(self.device, device_block, self.host, host_block)
        for host_block, device_block in in_pairs:
            assert 0 <= device_block < self.num_blocks and 0 <= host_block < self.num_host_blocks
            self._copy_block(self.host, host_block, self.device, device_block)
        for host_block, _ in in_pairs:  # the host block is free again: forget what it held
            for offset in range(self.block_size):
                self.host.pop(host_block * self.block_size + offset, None)
        written: set[int] = set()
        # Write this iteration's KV first: attention reads it in the same forward.
        for sched in scheduler_output.scheduled:
            assert sched.num_scheduled_tokens >= 1, sched
            assert len(sched.block_table) >= cdiv(sched.seq_len, self.block_size), sched
            if self.strict:
                assert len(set(sched.block_table)) == len(sched.block_table), sched
            true_tokens = self.lookup(sched.request_id).all_token_ids
            assert sched.token_ids == true_tokens[sched.num_computed_tokens : sched.seq_len]
            if self.strict:
                assert sched.sample == (sched.seq_len == len(true_tokens)), sched
            for offset, token_id in enumerate(sched.token_ids):
                slot = self.slot(sched.block_table, sched.num_computed_tokens + offset)
                assert slot not in written, f"two tokens of one batch written to slot {slot}"
                written.add(slot)
                self.device[slot] = token_id
        sampled = {}
        for sched in scheduler_output.scheduled:
            true_tokens = self.lookup(sched.request_id).all_token_ids
            for position in range(sched.seq_len):
                slot = self.slot(sched.block_table, position)
                assert self.device.get(slot) == true_tokens[position], (
                    f"{sched.request_id}: position {position} reads slot {slot} holding "
                    f"{self.device.get(slot)}, expected {true_tokens[position]}"
                )
            if sched.sample:
                sampled[sched.request_id] = self.sample(sched.request_id, sched.seq_len)
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def check_host(self, request: Request, host_table: list[int]) -> None:
        """A swapped request's host blocks hold its computed tokens."""
        for position in range(request.num_computed_tokens):
            slot = self.slot(host_table, position)
            assert self.host.get(slot) == request.all_token_ids[position], (
                f"{request.request_id}: host slot {slot} of position {position} holds "
                f"{self.host.get(slot)}, expected {request.all_token_ids[position]}"
            )


# ----------------------------------------------------------------- harness


class Harness:
    """An LLMEngine on a fake runner; checks integrity after every step.

    The runner is ``runner`` (a :class:`FakeRunner` by default), or with ``simulate_kv`` a
    :class:`KVSimRunner` over the engine's pools that samples with ``sample``. ``clock``
    is the engine's clock and then also gives requests their default arrival time.
    ``max_steps`` bounds :meth:`run` and :meth:`run_batches`. Other keyword arguments go to
    :meth:`EngineConfig.from_kwargs`.
    """

    def __init__(
        self,
        runner: FakeRunner | None = None,
        *,
        simulate_kv: bool = False,
        strict: bool = False,
        sample: Sampler = token_for,
        num_host_blocks: int = 0,
        preemption_costs: PreemptionCosts | None = None,
        clock: Callable[[], float] | None = None,
        vocab_size: int = VOCAB_SIZE,
        max_steps: int = 200,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("max_model_len", 64)
        kwargs.setdefault("num_kv_blocks", 64)
        kwargs.setdefault("block_size", 4)
        kwargs.setdefault("max_num_batched_tokens", 64)
        kwargs.setdefault("max_num_seqs", min(8, kwargs["max_num_batched_tokens"]))
        kwargs.setdefault("kv_watermark", 0.0)
        kwargs.setdefault("enable_prefix_caching", False)
        self.runner: FakeRunner | KVSimRunner
        if simulate_kv:
            assert runner is None
            self.runner = KVSimRunner(
                kwargs["block_size"],
                kwargs["num_kv_blocks"],
                self.request,
                sample,
                num_host_blocks,
                strict,
            )
        else:
            self.runner = runner or FakeRunner()
        self.engine = build_engine(
            EngineConfig.from_kwargs(**kwargs),
            self.runner,
            None,
            ModelInfo(vocab_size, frozenset({EOS}), kwargs["num_kv_blocks"], num_host_blocks),
            clock=clock or monotonic_clock,
            preemption_costs=preemption_costs,
        )
        self.scheduler = self.engine.scheduler
        self.clock = clock
        self.kv = self.scheduler.kv
        self.max_steps = max_steps
        self.finished: dict[str, RequestOutput] = {}

    # --------------------------------------------------------------- requests

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int] | int = 3,
        max_tokens: int = 4,
        **kwargs: Any,
    ) -> None:
        """Queue a request (an int prompt is ``numbered_prompt``); with a clock it arrives now."""
        if isinstance(prompt_token_ids, int):
            prompt_token_ids = self.numbered_prompt(request_id, prompt_token_ids)
        if self.clock is not None and kwargs.get("arrival_time") is None:
            kwargs["arrival_time"] = self.clock()
        self.engine.add_request(
            request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens), **kwargs
        )

    def numbered_prompt(self, request_id: str, n: int) -> list[int]:
        """The prompt of ``add(request_id, n)``."""
        return prompt(n)

    def abort(self, request_id: str) -> RequestOutput:
        (out,) = self.engine.abort_request(request_id)
        self.scheduler.check_integrity()
        assert out.finished
        self.finished[out.request_id] = out
        return out

    def request(self, request_id: str) -> Request:
        return self.scheduler.requests[request_id]

    def status(self, request_id: str) -> RequestStatus:
        return self.request(request_id).status

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.block_ids(request_id)

    @property
    def kv_free(self) -> int:
        return self.kv.pool.num_free_blocks

    # --------------------------------------------------------------- steps

    def check(self) -> None:
        """Scheduler integrity, and the host copies of swapped requests on a KV simulation."""
        self.scheduler.check_integrity()
        if isinstance(self.runner, KVSimRunner):
            for request in self.scheduler.swapped:
                self.runner.check_host(request, self.kv.host_block_ids(request.request_id))

    def step(self) -> list[Row]:
        """One engine step; returns the batch the runner got ([] when none ran)."""
        num_batches = len(self.runner.outputs)
        for out in self.engine.step():
            if out.finished:
                assert out.request_id not in self.finished
                self.finished[out.request_id] = out
        self.check()
        if len(self.runner.outputs) == num_batches:
            return []
        return [
            (s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.sample)
            for s in self.runner.outputs[-1].scheduled
        ]

    def step_batch(self) -> tuple[list[Row], int]:
        """One engine step: the batch the runner got and the number running after it."""
        rows = self.step()
        return rows, len(self.scheduler.running)

    def run(self, max_steps: int | None = None) -> dict[str, RequestOutput]:
        """Step until every request has finished; returns the finished outputs."""
        for _ in range(self.max_steps if max_steps is None else max_steps):
            if not self.engine.has_unfinished_requests():
                return self.finished
            self.step()
        raise AssertionError(f"not finished after {max_steps or self.max_steps} steps")

    def run_batches(self) -> list[tuple[list[Row], int]]:
        """Step until every request has finished; returns what :meth:`step_batch` saw."""
        steps: list[tuple[list[Row], int]] = []
        for _ in range(self.max_steps):
            if not self.engine.has_unfinished_requests():
                return steps
            steps.append(self.step_batch())
        raise AssertionError(f"not finished after {self.max_steps} steps")

    # --------------------------------------------------------------- what the runner saw

    def last_output(self) -> SchedulerOutput:
        return self.runner.outputs[-1]

    def preempted(self) -> list[str]:
        return self.last_output().preempted_request_ids

    def sampled_positions(self, request_id: str) -> list[int]:
        return [
            s.seq_len
            for o in self.runner.outputs
            for s in o.scheduled
            if s.request_id == request_id and s.sample
        ]


# ----------------------------------------------------------------- random workloads


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_step: int
    abort_step: int | None
    priority: int | None = None


@dataclass(frozen=True)
class Scenario:
    """Engine settings and a workload whose outputs are sampled by :func:`random_token`."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int
    enable_prefix_caching: bool
    requests: list[RequestSpec]
    enable_chunked_prefill: bool = True
    kv_watermark: float = 0.0
    num_host_blocks: int = 0
    preemption_mode: str = "auto"
    costs: PreemptionCosts | None = None
    vocab_size: int = VOCAB_SIZE
    priority_preemption_margin: int = 0

    def engine_kwargs(self) -> dict[str, Any]:
        """The settings every scenario passes to the engine config."""
        return {
            "max_model_len": self.max_model_len,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "enable_prefix_caching": self.enable_prefix_caching,
            "priority_preemption_margin": self.priority_preemption_margin,
        }

    def sample(self, request_id: str, position: int) -> int:
        return random_token(request_id, position, self.vocab_size)

    def is_valid(self, spec: RequestSpec) -> bool:
        """What LLMEngine.validate accepts (prompt tokens are always in the vocab here)."""
        num_prompt = len(spec.prompt_token_ids)
        return (
            num_prompt >= 1
            and num_prompt + spec.max_tokens <= self.max_model_len
            and cdiv(num_prompt, self.block_size) <= self.num_kv_blocks
        )

    def expected(self, spec: RequestSpec) -> tuple[list[int], str]:
        """Output tokens and finish reason of a request that is not aborted.

        The j-th output token (position P + j) needs the KV of P + j tokens; when that is more
        than the whole device pool holds, the request ends with ``length``.
        """
        num_prompt = len(spec.prompt_token_ids)
        capacity = self.num_kv_blocks * self.block_size
        out: list[int] = []
        for j in range(spec.max_tokens):
            if num_prompt + j > capacity:
                return out, "length"
            token_id = self.sample(spec.request_id, num_prompt + j)
            out.append(token_id)
            if token_id == EOS:
                return out, "stop"
        return out, "length"


BOMB_PROMPT = [13, 13, 13]


def build_fragile_engine(**kwargs: Any) -> LLMEngine:
    """An engine (fake runner) whose scheduler raises while a request with prompt
    :data:`BOMB_PROMPT` waits: a stand-in for a bug outside the forward (a
    ``ProcessEngine`` factory)."""
    harness = Harness(**kwargs)
    engine = harness.engine
    schedule = engine.scheduler.schedule

    def fragile() -> SchedulerOutput:
        if any(r.prompt_token_ids == BOMB_PROMPT for r in engine.scheduler.waiting):
            raise RuntimeError("a scheduler bug")
        return schedule()

    engine.scheduler.schedule = fragile  # type: ignore[method-assign]
    return engine


STALL_S = 60.0


def build_stalling_engine(**kwargs: Any) -> LLMEngine:
    """An engine (fake runner) whose every iteration first says ``"stalling"`` on stdout and
    then takes :data:`STALL_S` seconds: a stand-in for a long forward or a hung device (a
    ``ProcessEngine`` factory)."""
    engine = Harness(**kwargs).engine
    step_deltas = engine.step_deltas

    def stalling() -> Any:
        print("stalling", flush=True)
        time.sleep(STALL_S)
        return step_deltas()

    engine.step_deltas = stalling  # type: ignore[method-assign]
    return engine


def build_failing_engine(bad_settings: bool = True, **kwargs: Any) -> LLMEngine:
    """A ``ProcessEngine`` factory that raises as a build does: a ConfigError (settings the
    model does not take) or, with ``bad_settings=False``, an unexpected error."""
    from iterserve.config import ConfigError

    if bad_settings:
        raise ConfigError("tensor_parallel_size 2 does not divide num_attention_heads 9")
    raise RuntimeError("a loader bug")
