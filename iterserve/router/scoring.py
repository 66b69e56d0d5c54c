"""Which replica gets a request: scores and picks as pure functions (no HTTP, no engine).

The router calls these with what it knows of each replica (its last load report, how many
requests the router sent it since, whether it is ready); the simulator's replay calls the
same ones, so a what-if replay routes as the router would.

Score of a ready replica (lower wins; docs/router.md)::

    score = w_kv * kv_cache_usage
          + w_waiting   * num_waiting / norm
          + w_in_flight * in_flight_since_report / norm
    norm  = max over ready replicas of (num_waiting + in_flight_since_report), at least 1

so the waiting queue and the router's own requests not yet in any report are on one scale,
and a burst does not all land on the replica that looked idlest when it last reported. A
replica without a report, or whose report is older than ``stale_after_s``, scores as
saturated (every term at its maximum). Ties are broken at random.

Prefix affinity (with ``least_kv``) places a request by its prefix key alone, so that every
router replica given the same replica set and load reports places a prefix on the same
replica (no per-process memory decides placement): consistent hashing with bounded loads
(Mirrokni, Thorup and Zadimoghaddam, SODA 2018; as KubeAI's PrefixHash) with two choices.
Walking the ring clockwise from the key's point, the first two replicas whose load (running +
waiting + in flight) is under the bound ``ceil(load_bound * (total + 1) / n)``, or under
``MIN_CAPACITY`` (at low load the strict bound would scatter a burst's requests for one prefix
for no gain), are the candidates; the lower ``least_kv`` score wins, ring order breaking ties.
A shared prefix so lives on at most two replicas while they have room, and an unshared one
balances by load nearly as well as without affinity (docs/router.md has the replay that chose
two choices over one).

With KV events (:mod:`iterserve.router.kv_index`) the picker knows which blocks each replica
holds: among the replicas under the bound, those holding the longest run of the prompt's
leading blocks are the candidates (two choices over them in ring order, as above); when no
replica under the bound holds the first block, the hash placement decides.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the index is built only with --kv-events-port
    from iterserve.router.kv_index import KvIndex

POLICIES = ("least_kv", "round_robin", "session", "random")
PREFIX_KEY_BYTES = 512
VIRTUAL_NODES = 64
MIN_CAPACITY = 4
NUM_CHOICES = 2  # candidates on the ring (the power of two choices)


class NoReplicaError(RuntimeError):
    """No ready replica to send a request to (the router answers 503)."""


@dataclass(frozen=True)
class LoadReport:
    """One replica's load as last reported (``/load``, or a vLLM/SGLang ``/metrics``).

    Attributes:
        kv_cache_usage: fraction of KV blocks in use, 0-1.
        num_waiting, num_running: requests.
        num_total_blocks: the replica's KV pool (weights its usage in aggregates; 0 unknown).
        received_at: when the router got it (seconds of the router's clock).
        draining: the replica is shutting down (iterserve's ``/load`` says so).
    """

    kv_cache_usage: float
    num_waiting: int
    num_running: int
    num_total_blocks: int = 0
    received_at: float = 0.0
    draining: bool = False  # the replica refuses new requests (shutting down)


@dataclass
class ReplicaState:
    """What the router knows of one replica."""

    name: str
    report: LoadReport | None = None
    in_flight_since_report: int = 0
    ready: bool = True

    @property
    def load(self) -> int:
        """Requests on it as far as the router knows: running + waiting + sent since."""
        r = self.report
        queued = (r.num_running + r.num_waiting) if r is not None else 0
        return queued + self.in_flight_since_report


@dataclass(frozen=True)
class ScoreWeights:
    kv: float = 1.0
    waiting: float = 1.0
    in_flight: float = 1.0


def is_stale(replica: ReplicaState, now: float, stale_after_s: float) -> bool:
    r = replica.report
    return r is None or now - r.received_at > stale_after_s


def scores(
    replicas: Sequence[ReplicaState],
    now: float,
    stale_after_s: float = 0.5,
    weights: ScoreWeights = ScoreWeights(),
) -> dict[str, float]:
    """The score of every replica in ``replicas`` (see the module docstring)."""
    fresh = [r for r in replicas if not is_stale(r, now, stale_after_s)]
    norm = max([1] + [r.report.num_waiting + r.in_flight_since_report for r in fresh if r.report])
    saturated = weights.kv + weights.waiting + weights.in_flight
    out = {}
    for r in replicas:
        if is_stale(r, now, stale_after_s) or r.report is None:
            out[r.name] = saturated
            continue
        out[r.name] = (
            weights.kv * min(1.0, max(0.0, r.report.kv_cache_usage))
            + weights.waiting * r.report.num_waiting / norm
            + weights.in_flight * r.in_flight_since_report / norm
        )
    return out


def prefix_key(
    prompt: str | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    token_ids: Sequence[int] | None = None,
) -> bytes:
    """The bytes a request's prefix is hashed by: the first 512 bytes of the prompt text; for
    chat, of the system message and the first user message; for a prompt given as token ids,
    of ``"ids:"`` and its ids in decimal, comma-separated (docs/router.md)."""
    if token_ids is not None:
        text = "ids:" + ",".join(str(t) for t in token_ids[:PREFIX_KEY_BYTES])
    elif messages is not None:
        parts = []
        for role in ("system", "user"):
            first = next((m for m in messages if m.get("role") == role), None)
            if first is not None:
                parts.append(f"{role}:{first.get('content')}")
        text = "\n".join(parts)
    else:
        text = prompt or ""
    return text.encode("utf-8", "replace")[:PREFIX_KEY_BYTES]


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing of keys onto replica names (``VIRTUAL_NODES`` points each)."""

    def __init__(self, names: Sequence[str]) -> None:
        points = sorted(
            (_hash(f"{name}#{i}".encode()), name) for name in names for i in range(VIRTUAL_NODES)
        )
        self._hashes = [h for h, _ in points]
        self._names = [n for _, n in points]
        self.names = frozenset(names)

    def walk(self, key: bytes) -> list[str]:
        """Every replica once, clockwise from ``key``'s point."""
        if not self._hashes:
            return []
        start = bisect.bisect(self._hashes, _hash(key)) % len(self._hashes)
        seen: dict[str, None] = {}
        for i in itertools.chain(range(start, len(self._names)), range(start)):
            seen.setdefault(self._names[i], None)
            if len(seen) == len(self.names):
                break
        return list(seen)


@dataclass(frozen=True)
class Pick:
    """A routing decision and why (the ``reason`` label of the router's pick metric)."""

    replica: ReplicaState
    reason: str


@dataclass
class Picker:
    """Picks a replica per request under ``policy`` (one of :data:`POLICIES`).

    Args:
        prefix_affinity: with ``least_kv``, place a request by its prefix (see the module
            docstring).
        load_bound: the bounded-load factor (a replica over it passes a prefix key on).
        seed: random tie-breaks of plain ``least_kv`` (no key) and the ``random`` policy
            (None: unseeded); never a prefix's placement.
        kv_index: the blocks each replica holds, from its KV events (None: hash placement
            alone).
        tokenize: a generation body's prompt as the replicas' token ids, or None
            (:func:`iterserve.router.prompt_tokens.prompt_token_ids`), for the KV index.

    Raises:
        ValueError: an unknown policy.
    """

    policy: str = "least_kv"
    prefix_affinity: bool = True
    stale_after_s: float = 0.5
    weights: ScoreWeights = ScoreWeights()
    load_bound: float = 1.25
    seed: int | None = None
    kv_index: KvIndex | None = None
    tokenize: Callable[[Mapping[str, Any]], list[int] | None] | None = None
    _rng: random.Random = field(init=False, repr=False)
    _ring: HashRing | None = field(default=None, init=False, repr=False)
    _next: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose from {POLICIES}")
        if not self.load_bound >= 1.0:
            raise ValueError(f"load_bound must be >= 1, got {self.load_bound}")
        self._rng = random.Random(self.seed)

    def pick(
        self,
        replicas: Sequence[ReplicaState],
        now: float,
        key: bytes | None = None,
        session: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> Pick:
        """The replica for one request among the ready ones.

        Args:
            key: the request's :func:`prefix_key` (affinity), if any.
            session: the session header's value (policy ``session``), if any.
            prompt_token_ids: the prompt's tokens as the replicas count them, for the KV
                events' match (:meth:`prompt_tokens`).

        Raises:
            NoReplicaError: no replica is ready.
        """
        ready = [r for r in replicas if r.ready]
        if not ready:
            raise NoReplicaError("no ready replica")
        if self.policy == "round_robin":
            self._next += 1
            return Pick(ready[(self._next - 1) % len(ready)], "round_robin")
        if self.policy == "random":
            return Pick(self._rng.choice(ready), "random")
        if self.policy == "session":
            if session is None:
                return Pick(self._least_kv(ready, now), "no_session")
            name = self._ring_for(ready).walk(session.encode())[0]
            return Pick(next(r for r in ready if r.name == name), "session")
        if self.prefix_affinity and key:
            return self._affine(ready, now, key, prompt_token_ids)
        return Pick(self._least_kv(ready, now), "least_kv")

    def wants_prompt_tokens(self) -> bool:
        """Whether :meth:`pick` would use a prompt's tokens: prefix affinity under
        ``least_kv`` with a tokenizer and a KV index that holds some block (tokenizing costs
        time: docs/router.md)."""
        return (
            self.tokenize is not None
            and self.kv_index is not None
            and self.policy == "least_kv"
            and self.prefix_affinity
            and self.kv_index.num_blocks() > 0
        )

    def prompt_tokens(self, body: Mapping[str, Any] | None) -> list[int] | None:
        """The prompt's token ids of a generation ``body`` when :meth:`wants_prompt_tokens`;
        else None."""
        if body is None or self.tokenize is None or not self.wants_prompt_tokens():
            return None
        return self.tokenize(body)

    def _affine(
        self,
        ready: list[ReplicaState],
        now: float,
        key: bytes,
        prompt_token_ids: Sequence[int] | None,
    ) -> Pick:
        """Bounded loads, two choices (see the module docstring); a function of the replica
        set, their loads and the KV index only."""
        by_name = {r.name: r for r in ready}
        bound = self.capacity(ready)
        walk = self._ring_for(ready).walk(key)
        # One is always under the bound: the bound exceeds the mean load.
        under = [name for name in walk if by_name[name].load < bound]
        if self.kv_index is not None and prompt_token_ids:
            matched = self.kv_index.matched_blocks(prompt_token_ids, under)
            longest = max(matched.values(), default=0)
            if longest > 0:
                holders = [name for name in under if matched[name] == longest]
                return Pick(self._lower_score(by_name, holders, now), "kv_match")
        chosen = self._lower_score(by_name, under, now)
        if chosen.name == walk[0]:
            return Pick(chosen, "prefix")
        return Pick(chosen, "prefix_second" if under[0] == walk[0] else "prefix_passed_on")

    def _lower_score(
        self, by_name: Mapping[str, ReplicaState], names: Sequence[str], now: float
    ) -> ReplicaState:
        """Of the first :data:`NUM_CHOICES` of ``names`` (ring order), the lower score; the
        earlier on the ring on a tie."""
        candidates = [by_name[n] for n in names[:NUM_CHOICES]]
        s = scores(candidates, now, self.stale_after_s, self.weights)
        return min(candidates, key=lambda r: s[r.name])  # min keeps the first of equals

    def capacity(self, ready: Sequence[ReplicaState]) -> int:
        """How many requests a replica may hold and still take a prefix it is home to:
        ``ceil(load_bound * (total + 1) / n)``, and at least ``MIN_CAPACITY`` so that at low
        load (a burst of a few requests) a home keeps its prefixes instead of balancing
        requests that cost nothing to pile up."""
        total = sum(r.load for r in ready)
        return max(MIN_CAPACITY, math.ceil(self.load_bound * (total + 1) / len(ready)))

    def _least_kv(self, ready: list[ReplicaState], now: float) -> ReplicaState:
        s = scores(ready, now, self.stale_after_s, self.weights)
        best = min(s.values())
        return self._rng.choice([r for r in ready if s[r.name] <= best + 1e-12])

    def _ring_for(self, ready: list[ReplicaState]) -> HashRing:
        names = frozenset(r.name for r in ready)
        if self._ring is None or self._ring.names != names:
            self._ring = HashRing(sorted(names))
        return self._ring
