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

Prefix affinity (with ``least_kv``): a request whose prefix key the picker has seen goes
back to the replica that served that prefix last, as long as that replica's load (running +
waiting + in flight) is below the bound of consistent hashing with bounded loads (Mirrokni,
Thorup and Zadimoghaddam, SODA 2018; as KubeAI's PrefixHash), ``ceil(load_bound * (total +
1) / n)``, or below ``MIN_CAPACITY`` (at low load the strict bound would scatter a burst's
requests for one prefix for no gain). Otherwise, and for a prefix never seen, the
``least_kv`` score picks and the key is remembered there (the last ``MAX_PREFIXES`` keys).
Unlike a pure hash ring this never sends a new prefix to a loaded replica only because of
where its hash falls, so unshared prompts balance as without affinity; the ring is kept for
``session`` stickiness, which must agree across router replicas.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("least_kv", "round_robin", "session", "random")
PREFIX_KEY_BYTES = 512
VIRTUAL_NODES = 64
MAX_PREFIXES = 65536
MIN_CAPACITY = 4


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
    prompt: str | None = None, messages: Sequence[Mapping[str, Any]] | None = None
) -> bytes:
    """The bytes a request's prefix is hashed by: the first 512 bytes of the prompt text; for
    chat, of the system message and the first user message (docs/router.md)."""
    if messages is not None:
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
        prefix_affinity: with ``least_kv``, keep a prefix on the replica that served it.
        load_bound: the bounded-load factor (a replica over it passes a prefix key on).
        seed: random tie-breaks and the ``random`` policy (None: unseeded).

    Raises:
        ValueError: an unknown policy.
    """

    policy: str = "least_kv"
    prefix_affinity: bool = True
    stale_after_s: float = 0.5
    weights: ScoreWeights = ScoreWeights()
    load_bound: float = 1.25
    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)
    _ring: HashRing | None = field(default=None, init=False, repr=False)
    _next: int = field(default=0, init=False, repr=False)
    # prefix key -> the replica that served it last (oldest first)
    _homes: OrderedDict[bytes, str] = field(default_factory=OrderedDict, init=False, repr=False)

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
    ) -> Pick:
        """The replica for one request among the ready ones.

        Args:
            key: the request's :func:`prefix_key` (affinity), if any.
            session: the session header's value (policy ``session``), if any.

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
            return self._affine(ready, now, key)
        return Pick(self._least_kv(ready, now), "least_kv")

    def _affine(self, ready: list[ReplicaState], now: float, key: bytes) -> Pick:
        key = hashlib.blake2b(key, digest_size=16).digest()  # remember digests, not prompts
        name = self._homes.get(key)
        home = next((r for r in ready if r.name == name), None)
        if home is not None and home.load < self.capacity(ready):
            self._homes.move_to_end(key)
            return Pick(home, "prefix")
        chosen = self._least_kv(ready, now)
        self._homes[key] = chosen.name
        self._homes.move_to_end(key)
        if len(self._homes) > MAX_PREFIXES:
            self._homes.popitem(last=False)
        return Pick(chosen, "prefix_new" if home is None else "prefix_passed_on")

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
