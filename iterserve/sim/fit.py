"""Fitting a latency profile's coefficients to measured iterations (``bench calibrate``).

The forward model (see :mod:`iterserve.sim.profile`) is::

    forward_s = fixed_s + max(f, a_d * D + a_p * P) + a_c * C + a_A * A + a_s * S_p

All coefficients are fitted by non-negative least squares (``scipy.optimize.nnls``: a cost
cannot be negative, and a free least-squares fit on collinear features happily trades a
negative coefficient for a larger one). Rows are weighted by ``1 / measured`` so the fit
minimises the sum of squared *relative* errors: the profile's quality is reported as an
absolute % error, and a 2 ms decode matters as much as a 2 s prefill.

The floor ``f`` (``linear_floor_s``) makes the model piecewise linear. For a fixed ``f`` and a
fixed set ``S`` of "floored" rows (those whose linear part is below ``f``) it is linear
again: a floored row's linear term is the constant ``f`` (moved to the measured side, its
``D`` and ``P`` columns zeroed), the other rows keep ``a_d * D + a_p * P``. So for each
candidate ``f`` we alternate: fit with ``S``, recompute ``S`` from the fitted ``a_d, a_p``,
refit, until ``S`` stops changing (or :data:`MAX_FLOOR_ITERATIONS`). Each candidate is
scored by the weighted residual of the true (``max``) model, and the best fit seen during
the alternation is kept, so a cycle cannot make a candidate look better than it is. The
candidates: 0 and a grid spanning the measured decode-only latencies, refined twice around
the best one; or exactly the ``floors`` given. Points the first fit misses by more than
``outlier_pct`` (a 2-core machine shared with other work has the odd iteration 3x slower
than its neighbours) are dropped and the fit done again, once.

Before the fit, calibration measures every shape several times (repeats) and
:func:`reject_outliers` drops, per shape, the repeats far from that shape's median: a value
``x`` of a group with median ``m`` is an outlier when ``|x - m| > k * s``, with the scale
``s = max(1.4826 * MAD, MIN_SCALE_REL * m)`` (MAD: the median absolute deviation from ``m``;
1.4826 makes it a standard deviation for normal data) and ``k = 3``, the "very conservative"
threshold of Leys et al., "Detecting outliers: Do not use standard deviation around the mean,
use absolute deviation around the median", J. Exp. Soc. Psychol. 49(4), 2013. The median and
MAD are not moved by the outliers themselves (a 20x slower repeat moves a mean and a standard
deviation as much as it is off), which is the point. The floor ``MIN_SCALE_REL`` keeps three
repeats that agree to within timer jitter from rejecting a fourth 3% off. The same robust
spread, ``1.4826 * MAD / m`` over the repeats of one shape, is the machine's noise
(:class:`Noise`): what the profile's error cannot be expected to beat.

numpy and scipy are imported here; only the calibration command and tests import this module
(the simulator proper stays numpy-free).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls  # type: ignore[import-untyped]

from iterserve.sim.profile import BatchShape, EngineOverhead, IterationModel

MAX_FLOOR_ITERATIONS = 50
# Floor candidates: this many steps from 0 to the slowest decode-only iteration, then this
# many steps between the best candidate's neighbours, REFINE_LEVELS times.
FLOOR_GRID_STEPS = 8
REFINE_LEVELS = 2
OUTLIER_ABS_PCT = 50.0
MAD_TO_SIGMA = 1.4826  # MAD x this = the standard deviation, for normally distributed data
OUTLIER_MADS = 3.0  # k of median +- k * MAD (Leys et al. 2013: 3 "very conservative")
MIN_SCALE_REL = 0.02  # the scale is at least 2% of the median (timer jitter is not an outlier)


@dataclass(frozen=True)
class Noise:
    """The spread of repeated measurements of the same shape (the machine's noise).

    Attributes:
        median_pct: median over the shapes of ``100 * 1.4826 * MAD / median`` (a robust
            coefficient of variation, %); 0 when no shape was measured twice.
        p90_pct: the 90th percentile of the same (%).
        num_shapes: shapes measured at least twice (those the figures are over).
        num_points: every measurement.
        num_rejected: measurements :func:`reject_outliers` dropped.
    """

    median_pct: float
    p90_pct: float
    num_shapes: int
    num_points: int
    num_rejected: int

    def describe(self) -> str:
        """One line for the report and the profile's notes."""
        return (
            f"noise (spread of repeats of one shape, 1.4826 x MAD / median): median "
            f"{self.median_pct:.1f}%, p90 {self.p90_pct:.1f}% over {self.num_shapes} shapes; "
            f"{self.num_rejected} of {self.num_points} measurements rejected as outliers "
            f"(median +- {OUTLIER_MADS:g} x scaled MAD per shape)"
        )


def robust_spread(values: Sequence[float]) -> tuple[float, float]:
    """(median, ``1.4826 * MAD``) of ``values`` (the same unit).

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("robust_spread needs at least one value")
    median = float(np.median(values))
    return median, MAD_TO_SIGMA * float(np.median(np.abs(np.asarray(values) - median)))


def outliers(
    values: Sequence[float], k: float = OUTLIER_MADS, min_scale_rel: float = MIN_SCALE_REL
) -> list[bool]:
    """Which of ``values`` (repeats of one shape) are outliers: ``|x - median| > k * scale``,
    ``scale = max(1.4826 * MAD, min_scale_rel * |median|)`` (module docstring). Fewer than
    three values: none (two repeats cannot say which one is off).

    Raises:
        ValueError: ``k`` or ``min_scale_rel`` is not positive.
    """
    if k <= 0 or min_scale_rel <= 0:
        raise ValueError(f"k and min_scale_rel must be > 0, got {k}, {min_scale_rel}")
    if len(values) < 3:
        return [False] * len(values)
    median, scale = robust_spread(values)
    scale = max(scale, min_scale_rel * abs(median))
    return [abs(v - median) > k * scale for v in values]


def reject_outliers(
    groups: Sequence[Sequence[float]], k: float = OUTLIER_MADS
) -> tuple[list[list[bool]], Noise]:
    """Per group (the repeats of one shape, seconds > 0): which values are outliers
    (:func:`outliers`), and the :class:`Noise` over the groups of two or more values.

    Raises:
        ValueError: a value is not positive, or ``k`` is not.
    """
    if any(v <= 0 for g in groups for v in g):
        raise ValueError("every measured time must be > 0 seconds")
    rejected = [outliers(g, k) for g in groups]
    spreads = []
    for g in groups:
        if len(g) >= 2:
            median, scale = robust_spread(g)
            spreads.append(100 * scale / median)
    median_pct, p90_pct = (
        (float(np.percentile(spreads, 50)), float(np.percentile(spreads, 90)))
        if spreads
        else (0.0, 0.0)
    )
    noise = Noise(
        median_pct=median_pct,
        p90_pct=p90_pct,
        num_shapes=len(spreads),
        num_points=sum(len(g) for g in groups),
        num_rejected=sum(sum(r) for r in rejected),
    )
    return rejected, noise


def fit_iteration_model(
    shapes: Sequence[BatchShape],
    seconds: Sequence[float],
    floors: Sequence[float] | None = None,
    outlier_pct: float | None = OUTLIER_ABS_PCT,
) -> IterationModel:
    """Fit the forward model to measured iterations.

    Args:
        shapes: the batch of each iteration (no swaps: calibration does not preempt).
        seconds: the measured forward time of each iteration (seconds, > 0).
        floors: candidate ``linear_floor_s`` values (seconds, >= 0); default: 0 and a grid
            spanning the decode-only iterations' latencies, refined around the best.
        outlier_pct: after a first fit, points it misses by more than this absolute %
            error are dropped and the fit is done again, once (a shared machine's hiccups:
            one iteration 3x slower than its neighbours of the same shape); None keeps all.

    Raises:
        ValueError: no points, lengths differ, a time is not positive, a shape has swaps,
            or a floor is negative.
    """
    features, y = _check_points(shapes, seconds)
    if floors is not None and (not floors or any(f < 0 for f in floors)):
        raise ValueError(f"floors must be a non-empty list of values >= 0, got {floors}")
    coef, floor = _fit(features, y, floors)
    if outlier_pct is not None:
        keep = np.abs(_predict(features, coef, floor) - y) / y * 100 <= outlier_pct
        if not keep.all() and keep.sum() > features.shape[1]:
            coef, floor = _fit(features[keep], y[keep], floors)
    fixed, a_d, a_p, a_c, a_attn, a_seq = (float(c) for c in coef)
    return IterationModel(
        fixed_s=fixed,
        linear_floor_s=float(floor),
        per_decode_token_s=a_d,
        per_prefill_token_s=a_p,
        per_context_token_s=a_c,
        per_attention_pair_s=a_attn,
        per_prefill_seq_s=a_seq,
    )


def fit_engine_overhead(num_seqs: Sequence[int], seconds: Sequence[float]) -> EngineOverhead:
    """Fit ``overhead_s = fixed_s + per_seq_s * num_seqs`` by non-negative least squares.

    Unweighted (absolute error): the overhead adds to the forward, so what matters is its
    error in seconds, and a relative weight would let the quickest iterations dominate.

    Args:
        num_seqs: requests in each iteration's batch.
        seconds: the engine's time around the forward in that iteration (seconds).

    Raises:
        ValueError: no points, or the lengths differ.
    """
    if not num_seqs or len(num_seqs) != len(seconds):
        raise ValueError(
            f"need equally many (>0) counts and times: {len(num_seqs)}, {len(seconds)}"
        )
    x = np.column_stack([np.ones(len(num_seqs)), np.asarray(num_seqs, dtype=float)])
    coef = _nnls_scaled(x, np.asarray(seconds, dtype=float))
    return EngineOverhead(fixed_s=float(coef[0]), per_seq_s=float(coef[1]))


def split_groups_held_out(
    groups: Sequence[Hashable], fraction: float = 0.2, seed: int = 0
) -> tuple[list[int], list[int]]:
    """Indices of ``groups`` (one label per point: its shape) split into (train, held-out)
    by label: every point of a held-out shape is held out, so a held-out point has no repeat
    of itself in the train set. :func:`split_held_out` over the distinct labels (in order of
    first appearance).

    Raises:
        ValueError: ``fraction`` outside ``[0, 1)``.
    """
    labels = list(dict.fromkeys(groups))
    _, held_labels = split_held_out(len(labels), fraction, seed)
    held = {labels[i] for i in held_labels}
    train = [i for i, g in enumerate(groups) if g not in held]
    return train, [i for i, g in enumerate(groups) if g in held]


def split_held_out(n: int, fraction: float = 0.2, seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices ``0..n-1`` split at random into (train, held-out), each sorted; the held-out
    part has ``round(n * fraction)`` of them (at least 1 when ``n >= 2``). Deterministic
    for a given ``seed``.

    Raises:
        ValueError: ``fraction`` outside ``[0, 1)``.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    num_held_out = round(n * fraction)
    if fraction > 0 and n >= 2:
        num_held_out = min(max(num_held_out, 1), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    return sorted(int(i) for i in order[num_held_out:]), sorted(
        int(i) for i in order[:num_held_out]
    )


def predict_forward_seconds(model: IterationModel, shapes: Sequence[BatchShape]) -> list[float]:
    """The model's forward time for each shape (seconds; no swap term)."""
    coef = np.array(
        [
            model.fixed_s,
            model.per_decode_token_s,
            model.per_prefill_token_s,
            model.per_context_token_s,
            model.per_attention_pair_s,
            model.per_prefill_seq_s,
        ]
    )
    features = np.array([s.features() for s in shapes], dtype=float).reshape(-1, 5)
    return [float(v) for v in _predict(features, coef, model.linear_floor_s)]


# ----------------------------------------------------------------- internals


def _check_points(
    shapes: Sequence[BatchShape], seconds: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    if not shapes or len(shapes) != len(seconds):
        raise ValueError(f"need equally many (>0) shapes and times: {len(shapes)}, {len(seconds)}")
    if any(s.num_swapped_blocks for s in shapes):
        raise ValueError("shapes with swapped blocks: the fit has no swap term")
    y = np.asarray(seconds, dtype=float)
    if not np.all(y > 0):
        raise ValueError("every measured time must be > 0 seconds")
    features = np.array([s.features() for s in shapes], dtype=float)  # [n, (D, P, C, A, S_p)]
    return features, y


def _fit(
    features: np.ndarray, y: np.ndarray, floors: Sequence[float] | None
) -> tuple[np.ndarray, float]:
    """Best (coefficients, floor) over the given floors, or the searched grid."""
    if floors is None:
        return _search_floor(features, y)
    coef, floor, _ = min((_fit_with_floor(features, y, f) for f in floors), key=lambda fit: fit[2])
    return coef, floor


def _predict(features: np.ndarray, coef: np.ndarray, floor: float) -> np.ndarray:
    linear = features[:, 0] * coef[1] + features[:, 1] * coef[2]
    return coef[0] + np.maximum(floor, linear) + features[:, 2:] @ coef[3:]


def _weighted_residual(
    features: np.ndarray, y: np.ndarray, coef: np.ndarray, floor: float
) -> float:
    """Sum of squared relative errors of the true (``max``) model."""
    return float(np.sum(((_predict(features, coef, floor) - y) / y) ** 2))


def _nnls_scaled(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """NNLS of ``x @ coef ~ y`` (rows scaled by ``weights``), with the columns normalised
    first: the features span ~1 (the constant) to ~1e7 (attention pairs)."""
    if weights is not None:
        x, y = x * weights[:, None], y * weights
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(x / scale, y)
    return np.asarray(coef / scale)


def _fit_with_floor(
    features: np.ndarray, y: np.ndarray, floor: float
) -> tuple[np.ndarray, float, float]:
    """(coefficients ``[fixed, a_d, a_p, a_c, a_A, a_s]``, floor, weighted residual) of the best
    fit for a fixed floor, alternating over the set of floored rows (module docstring)."""
    n = len(y)
    weights = 1.0 / y
    floored = np.zeros(n, dtype=bool)
    best: tuple[np.ndarray, float] | None = None
    seen: set[bytes] = set()
    for _ in range(MAX_FLOOR_ITERATIONS):
        x = np.column_stack([np.ones(n), features])
        x[floored, 1:3] = 0.0
        coef = _nnls_scaled(x, y - floor * floored, weights)
        residual = _weighted_residual(features, y, coef, floor)
        if best is None or residual < best[1]:
            best = (coef, residual)
        seen.add(floored.tobytes())
        if floor == 0:
            break
        floored = features[:, 0] * coef[1] + features[:, 1] * coef[2] < floor
        if floored.tobytes() in seen:  # converged (or cycling: keep the best seen)
            break
    assert best is not None
    return best[0], floor, best[1]


def _search_floor(features: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Best (coefficients, floor) over 0 and a refined grid spanning the decode-only
    iterations' latencies."""
    decode_only = y[features[:, 1] == 0]
    fits = [_fit_with_floor(features, y, 0.0)]
    if len(decode_only) == 0:
        return fits[0][0], 0.0
    low, high = 0.0, float(decode_only.max())
    for _ in range(REFINE_LEVELS + 1):
        step = (high - low) / FLOOR_GRID_STEPS
        candidates = [low + k * step for k in range(1, FLOOR_GRID_STEPS + 1)]
        fits += [_fit_with_floor(features, y, f) for f in candidates]
        best_floor = min(fits, key=lambda fit: fit[2])[1]
        low, high = max(0.0, best_floor - step), best_floor + step
    coef, floor, _ = min(fits, key=lambda fit: fit[2])
    return coef, floor
