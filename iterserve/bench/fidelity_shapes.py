"""The trace shapes of ``iterserve bench fidelity``: traffic the latency profile was not fitted on.

A profile is fitted on single iterations of a fixed grid (``bench calibrate``); a shape is a
whole trace with its own arrival process, prompt mix and server settings. Rates are relative
to the capacity the simulator predicts for the shape's requests sent all at once (requests
per second of that burst's replay), so the same shape loads a slow and a fast machine alike:

    shape          workload        arrivals                          server settings
    poisson-low    mixed           Poisson at 0.6x capacity          defaults
    poisson-high   mixed           Poisson at 1.5x capacity          defaults
    bursty         mixed           groups of 8 at once, 0.8x mean    defaults
    long-prompt    long-prompt     Poisson at 0.6x capacity          defaults
    shared-prefix  shared-prefix   Poisson at 0.8x capacity          defaults (prefix cache on)
                   (4 system prompts)
    tiers          mixed           Poisson at 1.5x capacity          FIDELITY_TIERS: queue-wait
                   (premium 20%, standard 50%, best-effort 30%)       limits, so some 429s

Each shape's seed is ``--seed`` + 100 x its row above (:func:`shape_seed`): no two shapes
share prompts, and a shape's trace is the same whichever others ``--shapes`` selects.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from iterserve.bench.serve import arrival_times
from iterserve.sim.profile import LatencyProfile
from iterserve.sim.replay import replay
from iterserve.sim.replica import SimTokenizer
from iterserve.workload.workloads import BenchRequest, make_workload

# Tiers of the ``tiers`` shape (as ``--tiers FILE`` and the simulator's ``tiers`` setting):
# queue-wait limits tight enough that 1.5x the capacity refuses some requests with a 429.
FIDELITY_TIERS: list[dict[str, Any]] = [
    {"name": "premium", "priority": 0, "max_queue_wait_ms": 2000},
    {"name": "standard", "priority": 1, "max_queue_wait_ms": 4000},
    {"name": "best-effort", "priority": 2, "max_queue_wait_ms": 6000},
]
TIER_MIX = (("premium", 0.2), ("standard", 0.5), ("best-effort", 0.3))


@dataclass(frozen=True)
class Shape:
    """One trace shape.

    Attributes:
        name: as ``--shapes`` names it.
        workload: a :data:`~iterserve.workload.workloads.WORKLOADS` name.
        load_factor: mean arrival rate as a fraction of the simulated burst capacity.
        burst: send groups of this many at once (None: Poisson arrivals).
        num_prefixes: ``shared-prefix``'s distinct system prompts.
        tiers: requests carry tier names (``TIER_MIX``) and the server runs
            ``FIDELITY_TIERS``.
    """

    name: str
    workload: str
    load_factor: float
    burst: int | None = None
    num_prefixes: int = 1
    tiers: bool = False

    def engine_kwargs(self, base: dict[str, Any]) -> dict[str, Any]:
        """The simulator's engine settings for this shape (``base`` plus its tiers)."""
        return {**base, "tiers": FIDELITY_TIERS} if self.tiers else dict(base)


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("poisson-low", "mixed", 0.6),
        Shape("poisson-high", "mixed", 1.5),
        Shape("bursty", "mixed", 0.8, burst=8),
        Shape("long-prompt", "long-prompt", 0.6),
        Shape("shared-prefix", "shared-prefix", 0.8, num_prefixes=4),
        Shape("tiers", "mixed", 1.5, tiers=True),
    )
}


def shape_seed(shape: Shape, seed: int) -> int:
    """The seed of ``shape``'s trace for the run's ``seed``."""
    return seed + 100 * list(SHAPES).index(shape.name)


def parse_shapes(text: str) -> list[Shape]:
    """``--shapes``: comma-separated names, or ``all``; in the order given.

    Raises:
        ValueError: an unknown or repeated name, or none.
    """
    if text.strip() == "all":
        return list(SHAPES.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise ValueError(
            f"unknown shape(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(SHAPES)} or all"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"a shape is named twice in {text!r}")
    return [SHAPES[n] for n in names]


@dataclass(frozen=True)
class ShapeTrace:
    """A shape's trace (arrival times set) and the rates it was built from (req/s)."""

    shape: Shape
    requests: list[BenchRequest]
    rate: float
    simulated_capacity_rps: float
    seed: int


def build_trace(
    shape: Shape,
    tokenizer: SimTokenizer,
    profile: LatencyProfile,
    engine_kwargs: dict[str, Any],
    num_requests: int,
    seed: int,
    max_output_len: int,
) -> ShapeTrace:
    """The shape's requests with their arrivals, at ``load_factor`` x the capacity the
    simulator predicts on ``profile`` for a burst of them (server default settings: tier
    limits would refuse part of the burst and inflate the capacity)."""
    requests = make_workload(
        shape.workload, tokenizer, num_requests, seed, max_output_len, shape.num_prefixes
    )
    if shape.tiers:
        requests = _with_tiers(requests, seed)
    burst = replay(requests, profile, dict(engine_kwargs), tokenizer, seed=seed)
    capacity = len(requests) / max(burst.duration_s, 1e-9)
    rate = shape.load_factor * capacity
    interval = shape.burst / rate if shape.burst else 0.0
    offsets = arrival_times(len(requests), rate, shape.burst, interval, seed)
    trace = [dataclasses.replace(r, arrival_s=o) for r, o in zip(requests, offsets, strict=True)]
    return ShapeTrace(shape, trace, rate, capacity, seed)


def _with_tiers(requests: list[BenchRequest], seed: int) -> list[BenchRequest]:
    rng = random.Random(f"tiers-{seed}")
    names = [name for name, _ in TIER_MIX]
    weights = [w for _, w in TIER_MIX]
    return [dataclasses.replace(r, priority=rng.choices(names, weights)[0]) for r in requests]
