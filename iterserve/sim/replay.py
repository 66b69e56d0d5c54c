"""What-if replay: a trace through simulated replicas in virtual time (``iterserve simulate``).

Each replica is the real engine (scheduler, block manager, detokenizer) over the simulated
runner, with the HTTP server's admission control (:class:`~iterserve.server.admission.
Admission`: ``max_waiting`` and tier queue-wait 429s) in front of it. Nothing sleeps: a
discrete-event loop moves one virtual clock from event to event::

    arrival at t    route to a replica (loads as of its last finished iteration), validate
                    (400), admit (429) or queue it; an idle replica starts an iteration at t
    iteration       a replica's engine steps at t; the runner advances the replica's clock by
                    the profile's forward time plus engine overhead, to t + L; the step's
                    tokens are delivered at t + L, when the next iteration starts

Arrivals at the same instant as an iteration's end join the next iteration (the real engine
applies commands at iteration boundaries). Tokens are timestamped when their iteration ends,
as a client would see them if HTTP and SSE cost nothing (see docs/simulator.md for the
limits). Requests are sent as ``bench serve`` sends them: ``ignore_eos`` with ``min_tokens =
max_tokens`` unless the trace sets ``min_tokens``.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any

from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.llm_engine import IterationError, LLMEngine
from iterserve.engine.messages import AddRequest, EngineLoad, RequestDelta
from iterserve.engine.sampling_params import SamplingParams
from iterserve.router.scoring import LoadReport, Picker, ReplicaState, prefix_key
from iterserve.server.admission import Admission, Rejected
from iterserve.server.protocol import APIError
from iterserve.server.tenants import resolve_tenant
from iterserve.sim.profile import LatencyProfile
from iterserve.sim.replica import SimTokenizer, VirtualClock, build_engine
from iterserve.sim.runner import SimulatedModelRunner
from iterserve.workload.stats import SLO, RequestRecord, distribution, summarize, summarize_by_tier
from iterserve.workload.workloads import BenchRequest

# The router's policies that make sense without a session header.
ROUTING_POLICIES = ("least_kv", "round_robin", "random")
# KV usage samples kept per replica in the result (evenly thinned).
MAX_KV_SAMPLES = 400


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
    arrival: float
    replica: _Replica
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


@dataclass
class ReplayResult:
    """One candidate config's replay."""

    records: list[RequestRecord]
    queue_s: list[tuple[str, float]]  # (tier, queue time) of requests that were scheduled
    duration_s: float  # virtual: from 0 to the last response
    wall_s: float  # real time the replay took
    num_preemptions: int
    rejected: dict[str, int]  # reason -> count: 429s (queue_full, queue_wait) and 400s (invalid)
    kv_usage: list[list[tuple[float, float]]]  # per replica: (time, usage)
    num_iterations: int
    busy_s: float  # virtual seconds the replicas spent in iterations, all together

    def report(self, name: str, slo: SLO) -> dict[str, Any]:
        """``bench serve``'s fields (``summary``, ``by_tier``) plus the simulator's own."""
        summary = summarize(self.records, self.duration_s, slo)
        by_tier = summarize_by_tier(self.records, self.duration_s, slo)
        summary["queue_ms"] = _dist_ms([q for _, q in self.queue_s])
        for tier, tier_summary in by_tier.items():
            tier_summary["queue_ms"] = _dist_ms([q for t, q in self.queue_s if t == tier])
        return {
            "config": name,
            "summary": summary,
            "by_tier": by_tier,
            "num_preemptions": self.num_preemptions,
            "num_rejected": sum(self.rejected.values()),
            "rejected_by_reason": self.rejected,
            "num_iterations": self.num_iterations,
            "mean_iteration_ms": self.busy_s / max(1, self.num_iterations) * 1000,
            "wall_s": self.wall_s,
            "speedup_vs_real_time": self.duration_s / max(self.wall_s, 1e-9),
            "kv_usage": [_thin(series) for series in self.kv_usage],
        }


def _dist_ms(values: list[float]) -> dict[str, float]:
    return distribution([v * 1000 for v in values])


def _thin(series: list[tuple[float, float]]) -> list[tuple[float, float]]:
    step = max(1, len(series) // MAX_KV_SAMPLES)
    return series[::step]


def tier_label(priority: str | int | None) -> str:
    """The tier a record is reported under, as ``bench serve`` labels it."""
    return "default" if priority is None else str(priority)


def prompt_token_ids(
    req: BenchRequest,
    tokenizer: SimTokenizer,
    rng: random.Random,
    ordinary: list[int],
    max_len: int,
) -> list[int]:
    """What the server would tokenize: the chat template of ``messages`` (text parts of a
    content list joined, as the server does), else the prompt; an entry with only
    ``prompt_len`` gets that many seeded ordinary ids (at most ``max_len``: more is refused
    anyway).

    Raises:
        ValueError: what the server answers 400 to (empty prompt or messages, a content the
            template or the tokenizer refuses).
    """
    if req.messages is not None:
        if not req.messages:
            raise ValueError("messages is empty")
        conversation = [
            {"role": m["role"], "content": _text(m.get("content"))} for m in req.messages
        ]
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (jinja raise_exception, ...)
            raise ValueError(f"the chat template rejects these messages: {e}") from e
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    if req.prompt:
        return list(tokenizer(req.prompt).input_ids)
    if req.prompt_len < 1:
        raise ValueError("the prompt is empty")
    return [rng.choice(ordinary) for _ in range(min(req.prompt_len, max_len))]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ValueError(f"message content must be a string or a list of parts, got {content!r}")


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
    """
    wall0 = time.perf_counter()
    rng = random.Random(seed)
    ordinary = tokenizer.ordinary_token_ids()
    now = VirtualClock()
    replicas = []
    for i in range(num_replicas):
        clock = VirtualClock()
        engine, _ = build_engine(
            profile, engine_kwargs, clock.advance, clock, tokenizer, include_engine_overhead=True
        )
        assert isinstance(engine.runner, SimulatedModelRunner)
        replicas.append(_Replica(i, engine, engine.runner, clock, Admission(now), engine.load()))
    if routing not in ROUTING_POLICIES:
        raise ValueError(f"unknown routing policy {routing!r}; choose from {ROUTING_POLICIES}")
    picker = Picker(routing, prefix_affinity, seed=seed)
    tracked: dict[str, _Tracked] = {}  # accepted requests
    rejected: dict[str, int] = {}
    records: list[RequestRecord] = []
    queue_s: list[tuple[str, float]] = []
    # (time, 0 = arrival / 1 = end of an iteration / 2 = wake an idle replica, sequence,
    # payload): at one instant, arrivals first, so they all join the iteration that starts.
    events: list[tuple[float, int, int, Any]] = []
    seq = itertools.count()
    pending = iter(enumerate(trace))

    def send_next(t: float) -> None:
        item = next(pending, None)
        if item is not None:
            heapq.heappush(events, (t, 0, next(seq), item))

    if concurrency is None:
        for i, req in pending:
            heapq.heappush(events, (req.arrival_s or 0.0, 0, next(seq), (i, req)))
    else:
        for _ in range(concurrency):
            send_next(0.0)

    def start_iteration(r: _Replica, t: float) -> None:
        r.clock.now = t
        try:
            deltas = r.engine.step_deltas()
        except IterationError as e:  # the engine aborted the requests of that iteration
            for request_id in e.request_ids:
                entry = tracked[request_id]
                entry.record.error, entry.record.status = f"engine error: {e.cause}", 500
                entry.replica.admission.left_queue(request_id, started=False)
            deltas = []
        if r.clock.now == t and not deltas:  # nothing could run: wait for the next arrival
            r.busy = False
            return
        r.busy = True
        heapq.heappush(events, (r.clock.now, 1, next(seq), (r, deltas)))

    def on_delta(delta: RequestDelta, t: float) -> None:
        entry = tracked[delta.request_id]
        rec = entry.record
        if entry.queue_s is None and delta.first_scheduled_time is not None:
            entry.queue_s = delta.first_scheduled_time - entry.arrival
            queue_s.append((rec.tier, entry.queue_s))
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
            if concurrency is not None:
                send_next(t)

    end = 0.0
    while events:
        t, kind, _, payload = heapq.heappop(events)
        now.now = end = max(end, t)
        if kind == 0:
            index, req = payload
            record = RequestRecord(ok=False, tier=tier_label(req.priority))
            records.append(record)
            r = _pick(picker, replicas, req, t)
            if _admit(str(index), req, record, r, t, tokenizer, rng, ordinary, rejected):
                tracked[str(index)] = _Tracked(record, t, r)
                if not r.busy:  # start once every arrival of this instant is in
                    heapq.heappush(events, (t, 2, next(seq), r))
            elif concurrency is not None:
                send_next(t)
            continue
        if kind == 2:
            if not payload.busy:
                start_iteration(payload, t)
            continue
        r, deltas = payload
        for delta in deltas:
            on_delta(delta, t)
        r.load = r.engine.load()
        r.routed_since_report = 0
        r.kv_usage.append((t, r.load.kv_cache_usage))
        if r.engine.has_unfinished_requests():
            start_iteration(r, t)
        else:
            r.busy = False
    for entry in tracked.values():  # never finished (only if nothing could ever run them)
        if entry.record.e2e_s is None:
            entry.record.ok = False
            entry.record.error = "did not finish"
    return ReplayResult(
        records=records,
        queue_s=queue_s,
        duration_s=end,
        wall_s=time.perf_counter() - wall0,
        num_preemptions=sum(r.engine.scheduler.num_preemptions for r in replicas),
        rejected=rejected,
        kv_usage=[r.kv_usage for r in replicas],
        num_iterations=sum(r.engine.num_iterations for r in replicas),
        busy_s=sum(r.runner.busy_s for r in replicas),
    )


def _admit(
    request_id: str,
    req: BenchRequest,
    record: RequestRecord,
    replica: _Replica,
    t: float,
    tokenizer: SimTokenizer,
    rng: random.Random,
    ordinary: list[int],
    rejected: dict[str, int],
) -> bool:
    """The replica's HTTP front, as ``serving.py``: validate (400), admit (429), queue.
    False when the request was refused (``record`` says why)."""
    engine = replica.engine
    min_tokens = req.output_len if req.min_tokens is None else req.min_tokens
    try:
        token_ids = prompt_token_ids(req, tokenizer, rng, ordinary, engine.max_model_len + 1)
        record.prompt_tokens = len(token_ids)
        params = SamplingParams(
            max_tokens=req.output_len, min_tokens=min_tokens, ignore_eos=True, temperature=0.0
        )
        priority = engine.resolve_priority(req.priority)
        engine.validate(token_ids, params)
        tenant = resolve_tenant(None, req.tenant)  # the trace's tenant, as the user field
        replica.admission.check(engine.scheduler.config, priority, tenant=tenant)
    except Rejected as e:
        record.status, record.error = e.status, e.reason
        rejected[e.reason] = rejected.get(e.reason, 0) + 1
        return False
    except (InvalidRequestError, APIError, ValueError, KeyError) as e:  # ValueError: encoding too
        record.status, record.error = 400, str(e)
        rejected["invalid"] = rejected.get("invalid", 0) + 1  # as the server's metric counts
        return False
    replica.admission.enqueue(request_id, priority, tenant)
    replica.routed_since_report += 1
    engine.add(AddRequest(request_id, token_ids, params, priority, t, tenant=tenant))
    return True
