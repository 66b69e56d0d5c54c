"""The fit recovers known coefficients from synthetic iterations (no model, milliseconds)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from iterserve.sim.fit import (
    fit_engine_overhead,
    fit_iteration_model,
    predict_forward_seconds,
    split_held_out,
)
from iterserve.sim.profile import BatchShape, IterationModel

CPU_LIKE = IterationModel(
    fixed_s=15e-3,
    per_decode_token_s=0.7e-3,
    per_prefill_token_s=0.75e-3,
    per_context_token_s=0.8e-6,
    per_attention_pair_s=0.7e-6,
)
# Memory-bound small batches: the linear part is floored below 100 decodes / 150 prefill tokens.
GPU_LIKE = IterationModel(
    fixed_s=3e-3,
    linear_floor_s=12e-3,
    per_decode_token_s=0.12e-3,
    per_prefill_token_s=0.08e-3,
    per_context_token_s=20e-9,
    per_attention_pair_s=5e-9,
)
NOISE = 0.01  # multiplicative, lognormal sigma


def _shapes() -> list[BatchShape]:
    """Decode batches x contexts, prefill chunks x offsets, and a few mixed iterations."""
    shapes = []
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for context in (128, 512, 2048):
            shapes.append(BatchShape(batch, 0, batch * context, 0.0, batch))
    for chunk in (16, 32, 64, 128, 256, 512, 1024):
        for offset in range(0, 2049, 256):
            pairs = chunk * offset + chunk * (chunk + 1) / 2
            shapes.append(BatchShape(0, chunk, 0, pairs, 1))
    for batch, chunk in ((4, 64), (16, 256), (64, 512)):
        shapes.append(BatchShape(batch, chunk, batch * 300, chunk * 100.0, batch + 1))
    return shapes


def _measure(model: IterationModel, shapes: list[BatchShape], seed: int = 0) -> list[float]:
    exact = predict_forward_seconds(model, shapes)
    noise = np.random.default_rng(seed).lognormal(0.0, NOISE, len(shapes))
    return [float(t * e) for t, e in zip(exact, noise, strict=True)]


def _rel_errors(fitted: IterationModel, truth: IterationModel) -> dict[str, float]:
    return {
        name: abs(getattr(fitted, name) - want) / want
        for name, want in truth.model_dump().items()
        if want > 0
    }


def _assert_close(fitted: IterationModel, truth: IterationModel, rel: float) -> None:
    for name, want in truth.model_dump().items():
        got = getattr(fitted, name)
        assert got >= 0, name
        assert got == pytest.approx(want, rel=rel, abs=1e-12), name


def test_recovers_coefficients_without_floor() -> None:
    shapes = _shapes()
    fitted = fit_iteration_model(shapes, _measure(CPU_LIKE, shapes))
    # 1% noise on ~100 points: every coefficient within 5%, the floor (truly 0) below 1 ms.
    assert fitted.linear_floor_s < 1e-3
    _assert_close(
        fitted, CPU_LIKE.model_copy(update={"linear_floor_s": fitted.linear_floor_s}), 0.05
    )


def test_recovers_coefficients_with_floor() -> None:
    shapes = _shapes()
    fitted = fit_iteration_model(shapes, _measure(GPU_LIKE, shapes))
    # The floor only shows above ~100 decodes, and there fixed_s trades against it: their sum
    # within 2%, the floor within 5%, every coefficient within 10% (over seeds 0-9).
    assert fitted.fixed_s + fitted.linear_floor_s == pytest.approx(15e-3, rel=0.02)
    assert fitted.linear_floor_s == pytest.approx(GPU_LIKE.linear_floor_s, rel=0.05)
    _assert_close(fitted, GPU_LIKE, 0.10)


def test_given_floors_are_the_only_candidates() -> None:
    shapes = _shapes()
    seconds = _measure(GPU_LIKE, shapes, seed=1)
    exact = fit_iteration_model(shapes, seconds, floors=[0.0, GPU_LIKE.linear_floor_s])
    assert exact.linear_floor_s == GPU_LIKE.linear_floor_s
    _assert_close(exact, GPU_LIKE, 0.05)
    assert fit_iteration_model(shapes, seconds, floors=[0.0]).linear_floor_s == 0.0


def test_hiccups_are_dropped() -> None:
    # Every 8th iteration 3x slower (another process took the cores): the refit without
    # them recovers the coefficients; keeping them (outlier_pct=None) does not.
    shapes = _shapes()
    seconds = [t * (3 if i % 8 == 0 else 1) for i, t in enumerate(_measure(CPU_LIKE, shapes))]
    fitted = fit_iteration_model(shapes, seconds)
    assert max(_rel_errors(fitted, CPU_LIKE).values()) < 0.02
    kept = fit_iteration_model(shapes, seconds, outlier_pct=None)
    assert max(_rel_errors(kept, CPU_LIKE).values()) > 0.05  # 0.09 on these points


def test_coefficients_stay_non_negative() -> None:
    # Times that fall with the batch size: a free least-squares fit would give a negative
    # per-decode-token cost; NNLS clamps it at 0 and puts the time into fixed_s.
    shapes = [BatchShape(b, 0, b * 100, 0.0, b) for b in (1, 2, 4, 8, 16)]
    fitted = fit_iteration_model(shapes, [0.05, 0.045, 0.04, 0.035, 0.03], floors=[0.0])
    assert all(v >= 0 for v in fitted.model_dump().values())
    assert fitted.per_decode_token_s == 0.0
    assert fitted.fixed_s > 0


def test_engine_overhead() -> None:
    num_seqs = [1, 2, 4, 8, 16, 32, 64] * 3
    noise = np.random.default_rng(0).normal(0.0, 1e-5, len(num_seqs))
    seconds = [1e-3 + 20e-6 * s + e for s, e in zip(num_seqs, noise, strict=True)]
    overhead = fit_engine_overhead(num_seqs, seconds)
    assert overhead.fixed_s == pytest.approx(1e-3, rel=0.05)
    assert overhead.per_seq_s == pytest.approx(20e-6, rel=0.05)
    # Overhead that shrinks with the batch: per_seq_s is clamped at 0.
    assert fit_engine_overhead([1, 10], [2e-3, 1e-3]).per_seq_s == 0.0


def test_split_is_deterministic_and_disjoint() -> None:
    train, test = split_held_out(101, 0.2, seed=3)
    assert (train, test) == split_held_out(101, 0.2, seed=3)
    assert len(test) == 20 and len(train) == 81
    assert set(train).isdisjoint(test) and sorted(train + test) == list(range(101))
    assert train == sorted(train) and test == sorted(test)
    assert split_held_out(101, 0.2, seed=4)[1] != test
    assert split_held_out(3, 0.2)[1] != []  # at least one held-out point
    assert split_held_out(0, 0.2) == ([], [])


@pytest.mark.parametrize(
    ("shapes", "seconds"),
    [
        ([], []),
        ([BatchShape(1, 0, 10, 0.0, 1)], [0.0]),
        ([BatchShape(1, 0, 10, 0.0, 1)], [0.01, 0.02]),
        ([BatchShape(1, 0, 10, 0.0, 1, num_swapped_blocks=2)], [0.01]),
    ],
)
def test_bad_points_raise(shapes: list[BatchShape], seconds: list[float]) -> None:
    with pytest.raises(ValueError):
        fit_iteration_model(shapes, seconds)


def test_prediction_matches_the_formula() -> None:
    shape = BatchShape(3, 40, 900, 1000.0, 4)
    (got,) = predict_forward_seconds(GPU_LIKE, [shape])
    m = GPU_LIKE
    linear = max(m.linear_floor_s, 3 * m.per_decode_token_s + 40 * m.per_prefill_token_s)
    want = m.fixed_s + linear + 900 * m.per_context_token_s + 1000 * m.per_attention_pair_s
    assert math.isclose(got, want)
