"""The fit recovers known coefficients from synthetic iterations, and repeats of one shape give
its outliers and the noise (no model, milliseconds)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from iterserve.sim.fit import (
    Noise,
    fit_engine_overhead,
    fit_iteration_model,
    outliers,
    predict_forward_seconds,
    reject_outliers,
    robust_spread,
    split_groups_held_out,
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
    per_prefill_seq_s=0.5e-3,
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
            shapes.append(BatchShape(0, chunk, 0, pairs, 1, num_prefill_seqs=1))
    for batch, chunk in ((4, 64), (16, 256), (64, 512)):
        shapes.append(BatchShape(batch, chunk, batch * 300, chunk * 100.0, batch + 1, 0, 1))
    # Fresh prompts arriving beside decodes (calibration's arrival cells): 1 to 3 chunks.
    for batch, chunk, num_chunks in ((2, 64, 1), (6, 64, 2), (3, 256, 1), (8, 128, 3)):
        pairs = num_chunks * chunk * (chunk + 1) / 2
        total = num_chunks * chunk
        shapes.append(
            BatchShape(batch, total, batch * 200, pairs, batch + num_chunks, 0, num_chunks)
        )
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


# ------------------------------------------------- repeats: outliers and the machine's noise


def test_a_slow_repeat_is_an_outlier_and_jitter_is_not() -> None:
    # One repeat 20x slower (another process took the cores): rejected, the others kept.
    assert outliers([0.024, 0.025, 0.500]) == [False, False, True]
    assert outliers([0.024, 0.025, 0.026, 0.300, 0.025]) == [False, False, False, True, False]
    # Three repeats agreeing to 0.1%: a fourth 3% off is timer jitter (the 2% floor x 3).
    assert outliers([0.0250, 0.02502, 0.02498, 0.02575]) == [False] * 4
    # ... but 10% off is not.
    assert outliers([0.0250, 0.02502, 0.02498, 0.0275]) == [False, False, False, True]
    # Two repeats cannot say which one is off.
    assert outliers([0.025, 0.5]) == [False, False]
    assert outliers([0.025]) == [False]


def test_outlier_threshold_is_median_plus_k_scaled_mads() -> None:
    values = [10.0, 11.0, 12.0, 13.0, 14.0]  # median 12, MAD 1, scale 1.4826
    median, scale = robust_spread(values)
    assert median == 12.0 and scale == pytest.approx(1.4826)
    # With a sixth value x > 14: median 12.5, MAD 1.5 (x does not move it, however large),
    # so the threshold is 12.5 + 3 x 1.4826 x 1.5 = 19.17: 19.1 stays, 19.2 goes.
    assert outliers([*values, 19.1]) == [False] * 6
    assert outliers([*values, 19.2]) == [False] * 5 + [True]
    assert outliers([*values, 1e6]) == [False] * 5 + [True]
    assert outliers([*values, 19.2], k=4) == [False] * 6


def test_noise_is_the_spread_of_repeats_of_one_shape() -> None:
    rng = np.random.default_rng(3)
    groups = [list(0.02 * (1 + i / 10) * rng.lognormal(0, 0.05, 5)) for i in range(40)]
    groups[3][1] *= 20  # two hiccups
    groups[7][4] *= 5
    groups.append([0.03])  # measured once: in no spread
    flags, noise = reject_outliers(groups)
    assert sum(map(sum, flags)) == noise.num_rejected >= 2
    assert flags[3][1] and flags[7][4]
    assert noise.num_shapes == 40 and noise.num_points == 201
    # Lognormal sigma 5% -> a robust CV near 5% (the hiccups do not inflate it).
    assert 3 < noise.median_pct < 7 and noise.median_pct <= noise.p90_pct < 12
    assert "median" in noise.describe() and "rejected" in noise.describe()


def test_noise_of_a_quiet_and_of_a_loaded_machine() -> None:
    quiet = [[0.020, 0.0201, 0.0199]] * 10
    # Another process on the cores: every repeat a different multiple of the quiet time.
    loaded = [[0.020, 0.060, 0.200]] * 10
    assert reject_outliers(quiet)[1].median_pct < 1
    assert reject_outliers(loaded)[1].median_pct > 90  # 1.4826 x 0.04 / 0.06


def test_repeats_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="> 0 seconds"):
        reject_outliers([[0.02, 0.0]])
    with pytest.raises(ValueError, match="k and min_scale_rel"):
        outliers([1.0, 2.0, 3.0], k=0)
    with pytest.raises(ValueError, match="at least one"):
        robust_spread([])
    assert reject_outliers([])[1] == Noise(0.0, 0.0, 0, 0, 0)


def test_held_out_split_by_shape_keeps_repeats_together() -> None:
    labels = [i % 10 for i in range(30)]  # 10 shapes, 3 repeats each, interleaved
    train, held = split_groups_held_out(labels, 0.2, seed=1)
    assert sorted(train + held) == list(range(30))
    held_labels = {labels[i] for i in held}
    assert len(held_labels) == 2 and len(held) == 6
    assert not held_labels & {labels[i] for i in train}
    assert split_groups_held_out(labels, 0.2, seed=1) == (train, held)
