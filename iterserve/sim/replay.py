"""What-if replay: a trace through simulated replicas in virtual time (``iterserve simulate``).

Each replica is the real engine (scheduler, block manager, detokenizer) over the simulated
runner, with the HTTP server's admission control (:class:`~iterserve.server.admission.
Admission`: ``max_waiting`` and tier queue-wait 429s) in front of it. Nothing sleeps: a
discrete-event loop (:class:`Replay`) moves one virtual clock from event to event, each kind
handled by its own method::

    Arrival at t        route to a replica (loads as of its last finished iteration), validate
                        (400), admit (429) or queue it; an idle replica gets a Wake at t
    Wake at t           the idle replica's engine steps at t (after every arrival at t); the
                        runner advances the replica's clock by the profile's forward time plus
                        engine overhead, to t + L, where the IterationEnd is scheduled
    IterationEnd at t   the step's tokens are delivered at t; the replica's next iteration
                        starts at t if it has work

Arrivals at the same instant as an iteration's end join the next iteration (the real engine
applies commands at iteration boundaries). Tokens are timestamped when their iteration ends; what
the HTTP side costs is the profile's ``serving`` (a request reaches the engine
``request_latency_s`` after it was sent, and the serving CPU lengthens each iteration; see
docs/simulator.md for the limits). Requests are sent as ``bench serve`` sends them:
``ignore_eos`` with ``min_tokens = max_tokens`` unless the trace sets ``min_tokens``.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from iterserve.engine.llm_engine import IterationError, LLMEngine
from iterserve.engine.messages import EngineLoad, RequestDelta
from iterserve.router.scoring import LoadReport, Picker, ReplicaState, prefix_key
from iterserve.server.admission import Admission
from iterserve.sim.front import admit, tier_label
from iterserve.sim.profile import LatencyProfile
from iterserve.sim.replica import SimTokenizer, VirtualClock, build_simulated_engine
from iterserve.sim.result import ReplayResult
from iterserve.sim.runner import SimulatedModelRunner
from iterserve.workload.stats import RequestRecord
from iterserve.workload.workloads import BenchRequest

# The router's policies that make sense without a session header.
ROUTING_POLICIES = ("least_kv", "round_robin", "random")


@dataclass
class _Replica:
    index: int
    engine: LLMEngine
    runner: SimulatedModelRunner
    clock: VirtualClock
    admission: Admission
    load: EngineLoad  # as of its last finished iteration (what /load reports)
    busy: bool = False
    routed_since_report: int = 0
    kv_usage: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class _Tracked:
    record: RequestRecord
    arrival: float  # sent (TTFT and e2e count from here)
    replica: _Replica
    reached: float  # at the engine's side (queue time counts from here)
    queue_s: float | None = None
    last_token_at: float | None = None


def _pick(picker: Picker, replicas: list[_Replica], req: BenchRequest, t: float) -> _Replica:
    """The router's pick (``iterserve.router.scoring``), on loads a poll of each replica's
    ``/load`` would return now: the counts as of its last finished iteration."""
    states = [
        ReplicaState(
            str(r.index),
            LoadReport(
                r.load.kv_cache_usage,
                r.load.num_waiting,
                r.load.num_running,
                r.load.num_total_blocks,
                received_at=t,
            ),
            r.routed_since_report,
        )
        for r in replicas
    ]
    key = prefix_key(req.prompt, req.messages) if (req.prompt or req.messages) else None
    pick = picker.pick(states, t, key)
    return replicas[int(pick.replica.name)]


class EventKind(IntEnum):
    """What happens at an instant, in the order events of one instant are handled: arrivals
    first, so that they all join the iteration that starts then."""

    ARRIVAL = 0  # a request reaches the router
    ITERATION_END = 1  # a replica's iteration ends: its tokens are delivered
    WAKE = 2  # an idle replica that was just given a request starts an iteration


@dataclass(frozen=True)
class Arrival:
    """A request reaching the engine's side: ``sent_at`` plus the profile's
    ``serving.request_latency_s`` (its TTFT counts from ``sent_at``)."""

    index: int  # position in the trace (the request id)
    request: BenchRequest
    sent_at: float


@dataclass(frozen=True)
class IterationEnd:
    replica: _Replica
    deltas: list[RequestDelta]


@dataclass(frozen=True)
class Wake:
    replica: _Replica


Event = Arrival | IterationEnd | Wake
_KIND_OF: dict[type[Event], EventKind] = {
    Arrival: EventKind.ARRIVAL,
    IterationEnd: EventKind.ITERATION_END,
    Wake: EventKind.WAKE,
}


@dataclass(frozen=True, order=True)
class _Scheduled:
    """An event in the queue, ordered by virtual time (seconds), then kind, then the order in
    which it was scheduled."""

    time: float
    kind: EventKind
    seq: int
    event: Event = field(compare=False)


class Replay:
    """One replay of a trace in virtual time: the event queue and one handler per event kind.

    See :func:`replay` for the arguments; :meth:`run` runs it once.
    """

    def __init__(
        self,
        trace: list[BenchRequest],
        profile: LatencyProfile,
        engine_kwargs: dict[str, Any],
        tokenizer: SimTokenizer,
        num_replicas: int = 1,
        routing: str = "least_kv",
        seed: int = 0,
        concurrency: int | None = None,
        prefix_affinity: bool = True,
    ) -> None:
        self.trace = trace
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.ordinary = tokenizer.ordinary_token_ids()
        self.now = VirtualClock()  # the router's and the admission queues' clock
        self.replicas = [
            _build_replica(i, profile, engine_kwargs, tokenizer, self.now)
            for i in range(num_replicas)
        ]
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {routing!r}; choose from {ROUTING_POLICIES}")
        self.picker = Picker(routing, prefix_affinity, seed=seed)
        self.tracked: dict[str, _Tracked] = {}  # accepted requests
        self.rejected: dict[str, int] = {}
        self.records: list[RequestRecord] = []
        self.queue_s: list[tuple[str, float]] = []
        self.events: list[_Scheduled] = []
        self.seq = itertools.count()
        self.pending = iter(enumerate(trace))
        self.end = 0.0  # virtual time of the last event handled
        self.request_latency_s = profile.serving.request_latency_s

    def run(self) -> ReplayResult:
        """Handle events until none is left; the result of the whole trace."""
        wall0 = time.perf_counter()
        if self.concurrency is None:
            for index, req in self.pending:
                self._arrive(req.arrival_s or 0.0, index, req)
        else:
            for _ in range(self.concurrency):
                self._send_next(0.0)
        while self.events:
            scheduled = heapq.heappop(self.events)
            t = scheduled.time
            self.now.now = self.end = max(self.end, t)
            match scheduled.event:
                case Arrival() as arrival:
                    self._on_arrival(arrival, t)
                case Wake() as wake:
                    self._on_wake(wake, t)
                case IterationEnd() as iteration_end:
                    self._on_iteration_end(iteration_end, t)
        return self._result(time.perf_counter() - wall0)

    def _push(self, t: float, event: Event) -> None:
        heapq.heappush(self.events, _Scheduled(t, _KIND_OF[type(event)], next(self.seq), event))

    def _send_next(self, t: float) -> None:
        """Closed loop: the next request of the trace arrives at ``t``, if one is left."""
        item = next(self.pending, None)
        if item is not None:
            self._arrive(t, *item)

    def _arrive(self, sent_at: float, index: int, req: BenchRequest) -> None:
        self._push(sent_at + self.request_latency_s, Arrival(index, req, sent_at))

    def _on_arrival(self, arrival: Arrival, t: float) -> None:
        """Route the request, then refuse it (400, 429) or queue it on its replica; an idle
        replica is woken once every arrival of this instant is in."""
        req = arrival.request
        record = RequestRecord(ok=False, tier=tier_label(req.priority))
        self.records.append(record)
        r = _pick(self.picker, self.replicas, req, t)
        request_id = str(arrival.index)
        accepted = admit(
            request_id, req, record, r.engine, r.admission, t, self.tokenizer, self.rng,
            self.ordinary, self.rejected,
        )  # fmt: skip
        if accepted:
            r.routed_since_report += 1
            self.tracked[request_id] = _Tracked(record, arrival.sent_at, r, t)
            if not r.busy:
                self._push(t, Wake(r))
        elif self.concurrency is not None:
            self._send_next(t)

    def _on_wake(self, wake: Wake, t: float) -> None:
        if not wake.replica.busy:
            self._start_iteration(wake.replica, t)

    def _on_iteration_end(self, end: IterationEnd, t: float) -> None:
        """Deliver the iteration's tokens, refresh what the replica's ``/load`` reports, and
        start its next iteration if it has work."""
        r = end.replica
        for delta in end.deltas:
            self._on_delta(delta, t)
        r.load = r.engine.load()
        r.routed_since_report = 0
        r.kv_usage.append((t, r.load.kv_cache_usage))
        if r.engine.has_unfinished_requests():
            self._start_iteration(r, t)
        else:
            r.busy = False

    def _start_iteration(self, r: _Replica, t: float) -> None:
        """Step ``r``'s engine at ``t``; the runner advances its clock by the iteration's
        latency, when the iteration's end is scheduled. A replica with nothing to run idles."""
        r.clock.now = t
        try:
            deltas = r.engine.step_deltas()
        except IterationError as e:  # the engine aborted the requests of that iteration
            for request_id in e.request_ids:
                entry = self.tracked[request_id]
                entry.record.error, entry.record.status = f"engine error: {e.cause}", 500
                entry.replica.admission.left_queue(request_id, started=False)
            deltas = []
        if r.clock.now == t and not deltas:  # nothing could run: wait for the next arrival
            r.busy = False
            return
        r.busy = True
        self._push(r.clock.now, IterationEnd(r, deltas))

    def _on_delta(self, delta: RequestDelta, t: float) -> None:
        """One request's new tokens at ``t``: its queue time, TTFT, ITLs and end."""
        entry = self.tracked[delta.request_id]
        rec = entry.record
        if entry.queue_s is None and delta.first_scheduled_time is not None:
            entry.queue_s = delta.first_scheduled_time - entry.reached
            self.queue_s.append((rec.tier, entry.queue_s))
        num_new = sum(len(c.new_token_ids) for c in delta.completions)
        if num_new:
            if rec.ttft_s is None:
                rec.ttft_s = t - entry.arrival
                entry.replica.admission.left_queue(delta.request_id)
            else:
                assert entry.last_token_at is not None
                rec.itl_s.extend([t - entry.last_token_at] * num_new)
            entry.last_token_at = t
            rec.output_tokens += num_new
        if delta.finished:
            entry.replica.admission.left_queue(delta.request_id, started=False)
            rec.e2e_s = t - entry.arrival
            rec.ok = rec.ttft_s is not None
            rec.status = 200
            if self.concurrency is not None:
                self._send_next(t)

    def _result(self, wall_s: float) -> ReplayResult:
        for entry in self.tracked.values():  # never finished (only if nothing could run them)
            if entry.record.e2e_s is None:
                entry.record.ok = False
                entry.record.error = "did not finish"
        replicas = self.replicas
        return ReplayResult(
            records=self.records,
            queue_s=self.queue_s,
            duration_s=self.end,
            wall_s=wall_s,
            num_preemptions=sum(r.engine.scheduler.num_preemptions for r in replicas),
            rejected=self.rejected,
            kv_usage=[r.kv_usage for r in replicas],
            num_iterations=sum(r.engine.num_iterations for r in replicas),
            busy_s=sum(r.runner.busy_s for r in replicas),
        )


def _build_replica(
    index: int,
    profile: LatencyProfile,
    engine_kwargs: dict[str, Any],
    tokenizer: SimTokenizer,
    now: VirtualClock,
) -> _Replica:
    """A replica on its own virtual clock, its admission queue on the router's (``now``)."""
    clock = VirtualClock()
    engine, _ = build_simulated_engine(
        profile, engine_kwargs, clock.advance, clock, tokenizer, include_engine_overhead=True
    )
    assert isinstance(engine.runner, SimulatedModelRunner)
    return _Replica(index, engine, engine.runner, clock, Admission(now), engine.load())


def replay(
    trace: list[BenchRequest],
    profile: LatencyProfile,
    engine_kwargs: dict[str, Any],
    tokenizer: SimTokenizer,
    num_replicas: int = 1,
    routing: str = "least_kv",
    seed: int = 0,
    concurrency: int | None = None,
    prefix_affinity: bool = True,
) -> ReplayResult:
    """Replay ``trace`` (arrival times in seconds from 0) in virtual time.

    Routing is the router's (``iterserve.router.scoring``): ``least_kv`` with prefix affinity
    unless ``prefix_affinity`` is off, ``round_robin`` or ``random``.

    With ``concurrency`` the loop is closed instead (as ``bench serve --concurrency``): that
    many requests are sent at 0, and each one that ends (or is refused) sends the next, at
    once; the trace's timestamps are ignored.

    Raises:
        ConfigError, TypeError: settings the engine or the profile refuses.
        ValueError: an unknown ``routing``.
    """
    return Replay(
        trace,
        profile,
        engine_kwargs,
        tokenizer,
        num_replicas,
        routing,
        seed,
        concurrency,
        prefix_affinity,
    ).run()
