"""What ``iterserve bench calibrate`` makes of its measured points: outliers rejected per shape
and the machine's noise (:func:`~iterserve.sim.fit.reject_outliers`), the fitted profile (fit
on a seeded 80% of the shapes, error on the other 20%), the error per cell, the check
against the held-out bound (:func:`refusal`), the report, ``points.json`` and the plot.

Torch-free: the model's side of the profile (its spec, KV pool, swap bandwidth, hardware)
comes in as :attr:`Measurement.base`, so this module runs on synthetic points in tests.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from iterserve.sim.fit import (
    OUTLIER_ABS_PCT,
    Noise,
    fit_engine_overhead,
    fit_iteration_model,
    reject_outliers,
    robust_spread,
    split_groups_held_out,
)
from iterserve.sim.profile import (
    BatchShape,
    FitError,
    LatencyProfile,
    abs_pct_errors,
    median_and_p90,
)

HELD_OUT_FRACTION = 0.2
# A cell may miss by up to this many times the bound before the profile is refused: the
# linear model averages over the grid (it misses small prefill chunks and mid-size decode
# batches by 15-20% on an idle machine, repeats within 1-2%), while a cell spoiled by
# another process is off by 50-100% or more.
CELL_BOUND_FACTOR = 2.0


@dataclass
class Point:
    """One measured iteration (seconds); ``repeat`` numbers the cell's runs from 0."""

    cell: str
    shape: BatchShape
    forward_s: float
    total_s: float
    repeat: int = 0

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.forward_s

    @property
    def key(self) -> tuple[str, BatchShape]:
        """The shape this point is a repeat of (within its cell)."""
        return self.cell, self.shape


@dataclass
class Measurement:
    """Everything a calibration run measured.

    Attributes:
        base: the profile's model side (``model``, ``kv_cache``, ``swap``,
            ``source.hardware``); its ``iteration`` and ``engine_overhead`` are replaced by
            the fit.
        points: every measured iteration of every repeat (warm-ups are not points).
        grid: the cells, in words (for the profile's method).
        repeats: runs of each cell after its warm-up.
        skipped: cells not run, with why.
        remeasure: runs a cell again (warm-up and repeats) and returns its new points; None:
            cells cannot be re-measured (synthetic points).
        dropped: the points of cells dropped as too noisy, and those a re-measurement
            replaced (not fitted; kept for ``points.json``).
    """

    base: LatencyProfile
    points: list[Point]
    grid: str
    repeats: int
    skipped: list[str] = field(default_factory=list)
    remeasure: Callable[[str], list[Point]] | None = None
    dropped: list[Point] = field(default_factory=list)


@dataclass
class CellError:
    """How well the fit predicts one cell (absolute % errors over its kept points)."""

    cell: str
    num_points: int
    median_pct: float  # all its kept points (train and held-out)
    p90_pct: float
    held_out_median_pct: float | None  # its held-out points; None: none held out
    noise_pct: float  # median spread of its shapes' repeats (1.4826 MAD / median, %)
    forward_ms: float  # median measured forward

    @property
    def judged_pct(self) -> float:
        """The error the bound is checked against: held-out when it has any."""
        return self.median_pct if self.held_out_median_pct is None else self.held_out_median_pct


@dataclass
class Fit:
    """A fitted profile and how it was made.

    ``train`` and ``held_out`` index ``points`` and hold only points not ``rejected``.
    ``errors`` is ``{"held-out" | "train": (median %, p90 %)}``.
    """

    profile: LatencyProfile
    points: list[Point]
    rejected: list[bool]
    train: list[int]
    held_out: list[int]
    errors: dict[str, tuple[float, float]]
    noise: Noise
    cells: list[CellError]


def fit_profile(m: Measurement, name: str, seed: int, notes: Sequence[str] = ()) -> Fit:
    """Reject outliers per shape, fit on the train shapes, measure the errors.

    Args:
        m: the measurement (at least two distinct shapes).
        name: the profile's name.
        seed: of the train/held-out split (by shape).
        notes: added to the profile's ``source.notes`` (re-measured or dropped cells).

    Raises:
        ValueError: no points, or too few to hold any out.
    """
    points = m.points
    if not points:
        raise ValueError("no points to fit: every cell was skipped or dropped")
    keys = list(dict.fromkeys(p.key for p in points))
    index = {k: [i for i, p in enumerate(points) if p.key == k] for k in keys}
    flags, noise = reject_outliers([[points[i].forward_s for i in index[k]] for k in keys])
    rejected = [False] * len(points)
    for k, group_flags in zip(keys, flags, strict=True):
        for i, flag in zip(index[k], group_flags, strict=True):
            rejected[i] = flag
    kept = [i for i in range(len(points)) if not rejected[i]]
    train_k, held_k = split_groups_held_out([points[i].key for i in kept], HELD_OUT_FRACTION, seed)
    train, held_out = [kept[j] for j in train_k], [kept[j] for j in held_k]
    if not train or not held_out:
        raise ValueError(f"{len(keys)} distinct shapes: too few to hold some out")
    shapes = [points[i].shape for i in train]
    iteration = fit_iteration_model(shapes, [points[i].forward_s for i in train])
    overhead = fit_engine_overhead(
        [s.num_seqs for s in shapes], [points[i].overhead_s for i in train]
    )
    draft = m.base.model_copy(
        update={"name": name, "iteration": iteration, "engine_overhead": overhead}
    )
    predicted = [draft.forward_seconds(p.shape) for p in points]
    errors = {
        split: median_and_p90(
            abs_pct_errors([predicted[i] for i in idx], [points[i].forward_s for i in idx])
        )
        for split, idx in (("held-out", held_out), ("train", train))
    }
    cells = _cell_errors(points, predicted, rejected, set(held_out))
    source = draft.source.model_copy(
        update={
            "date": datetime.date.today().isoformat(),
            "method": _method(m),
            "fit_error": FitError(
                median_abs_pct=errors["held-out"][0],
                p90_abs_pct=errors["held-out"][1],
                num_train=len(train),
                num_held_out=len(held_out),
            ),
            "references": [
                "Vidur (Agrawal et al., MLSys 2024)",
                "Leys et al., Detecting outliers: use absolute deviation around the median "
                "(J. Exp. Soc. Psychol. 49(4), 2013)",
            ],
            "notes": _notes(m, points, predicted, train, errors, noise, notes),
        }
    )
    profile = draft.model_copy(update={"source": source})
    return Fit(profile, points, rejected, train, held_out, errors, noise, cells)


def refusal(fit: Fit, max_held_out_error_pct: float) -> list[str]:
    """Why ``fit`` is not good enough to write (empty: it is): the held-out median error
    over the bound, and each cell whose error (held-out, else over all its points) is over
    :data:`CELL_BOUND_FACTOR` times the bound."""
    reasons = []
    held_median = fit.errors["held-out"][0]
    if held_median > max_held_out_error_pct:
        reasons.append(
            f"held-out median error {held_median:.1f}% > {max_held_out_error_pct:g}% "
            f"(p90 {fit.errors['held-out'][1]:.1f}%)"
        )
    cell_bound = CELL_BOUND_FACTOR * max_held_out_error_pct
    reasons += [
        f"cell {c.cell}: error {c.judged_pct:.1f}% > {cell_bound:g}% "
        f"(forward {c.forward_ms:.1f} ms, its repeats spread {c.noise_pct:.1f}%)"
        for c in fit.cells
        if c.judged_pct > cell_bound
    ]
    if reasons:
        reasons.append(fit.noise.describe())
    return reasons


def _cell_errors(
    points: list[Point], predicted: list[float], rejected: list[bool], held: set[int]
) -> list[CellError]:
    cells = []
    for cell in dict.fromkeys(p.cell for p in points):
        mine = [i for i, p in enumerate(points) if p.cell == cell and not rejected[i]]
        errs = abs_pct_errors([predicted[i] for i in mine], [points[i].forward_s for i in mine])
        held_errs = [e for i, e in zip(mine, errs, strict=True) if i in held]
        spreads = []
        for key in dict.fromkeys(points[i].key for i in mine):
            values = [p.forward_s for p in points if p.key == key]
            if len(values) >= 2:
                median, scale = robust_spread(values)
                spreads.append(100 * scale / median)
        med, p90 = median_and_p90(errs)
        cells.append(
            CellError(
                cell=cell,
                num_points=len(mine),
                median_pct=med,
                p90_pct=p90,
                held_out_median_pct=statistics.median(held_errs) if held_errs else None,
                noise_pct=statistics.median(spreads) if spreads else 0.0,
                forward_ms=statistics.median(points[i].forward_s for i in mine) * 1e3,
            )
        )
    return cells


def _method(m: Measurement) -> str:
    spec = m.base.model
    return (
        f"iterserve bench calibrate: {spec.name} in {spec.dtype} on the real engine, {m.grid}; "
        f"each cell warmed up (a discarded run over the same shapes), then run {m.repeats} "
        f"times; every iteration's forward (execute_model) timed; per shape, repeats beyond "
        f"median +- 3 x 1.4826 MAD rejected; NNLS fit weighted by 1/measured on a seeded "
        f"{1 - HELD_OUT_FRACTION:.0%} of the shapes, error on the other "
        f"{HELD_OUT_FRACTION:.0%} (every repeat of a held-out shape held out)"
    )


def _notes(
    m: Measurement,
    points: list[Point],
    predicted: list[float],
    train: list[int],
    errors: dict[str, tuple[float, float]],
    noise: Noise,
    extra: Sequence[str],
) -> list[str]:
    num_off = sum(
        abs(predicted[i] - points[i].forward_s) > OUTLIER_ABS_PCT / 100 * points[i].forward_s
        for i in train
    )
    return [
        f"train error: median {errors['train'][0]:.1f}%, p90 {errors['train'][1]:.1f}%",
        noise.describe(),
        f"{num_off} train iterations are off by > {OUTLIER_ABS_PCT:.0f}% (the fit leaves such "
        "points out of its refit)",
        f"load average at the end: {os.getloadavg()[0]:.2f}",
        *[f"skipped {s}" for s in m.skipped],
        *extra,
    ]


def report(fit: Fit) -> str:
    """The fit-error table, the noise, the coefficients, and the error per cell."""
    profile, errors = fit.profile, fit.errors
    lines = [f"{'':16}{'held-out':>10}{'train':>10}"]
    lines.append(f"{'points':16}{len(fit.held_out):>10}{len(fit.train):>10}")
    lines.append(f"{'median |err| %':16}{errors['held-out'][0]:>10.1f}{errors['train'][0]:>10.1f}")
    lines.append(f"{'p90 |err| %':16}{errors['held-out'][1]:>10.1f}{errors['train'][1]:>10.1f}")
    lines.append(fit.noise.describe())
    lines.append("forward model (seconds):")
    lines += [f"  {k:22} {v:.4g}" for k, v in profile.iteration.model_dump().items()]
    o = profile.engine_overhead
    lines.append(f"engine overhead: {o.fixed_s * 1e3:.3f} ms + {o.per_seq_s * 1e6:.1f} us/seq")
    lines.append(f"swap: {profile.swap.bytes_per_s / 1e9:.2f} GB/s")
    lines.append(
        f"{'cell':20}{'points':>7}{'median %':>10}{'p90 %':>8}{'held-out %':>11}"
        f"{'noise %':>9}{'forward ms':>12}"
    )
    for c in fit.cells:
        held = "-" if c.held_out_median_pct is None else f"{c.held_out_median_pct:.1f}"
        lines.append(
            f"{c.cell:20}{c.num_points:>7}{c.median_pct:>10.1f}{c.p90_pct:>8.1f}{held:>11}"
            f"{c.noise_pct:>9.1f}{c.forward_ms:>12.1f}"
        )
    return "\n".join(lines)


def save_points(
    fit: Fit, path: Path, refused: Sequence[str] = (), dropped: Sequence[Point] = ()
) -> None:
    """Every point, its prediction, whether it was rejected or held out, and the points not
    fitted (``dropped``: of cells dropped as too noisy, or replaced by a re-measurement;
    flagged ``dropped``); the noise, the per-cell errors and the reasons of a refusal (JSON)."""
    held = set(fit.held_out)
    fitted = [(p, i in held, fit.rejected[i], False) for i, p in enumerate(fit.points)]
    rows = [
        {"cell": p.cell, "repeat": p.repeat, **asdict(p.shape)}
        | {"forward_s": p.forward_s, "total_s": p.total_s}
        | {"predicted_s": fit.profile.forward_seconds(p.shape), "held_out": is_held}
        | {"rejected": is_rejected, "dropped": is_dropped}
        for p, is_held, is_rejected, is_dropped in fitted
        + [(p, False, False, True) for p in dropped]
    ]
    document = {
        "profile": fit.profile.name,
        "noise": asdict(fit.noise),
        "cells": [asdict(c) for c in fit.cells],
        "refused": list(refused),
        "points": rows,
    }
    path.write_text(json.dumps(document, indent=1) + "\n")


def plot(fit: Fit, path: Path) -> None:
    """Predicted vs measured forward time, log-log: train, held-out and rejected points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile, held = fit.profile, set(fit.held_out)
    groups = (
        ("train", set(fit.train), "tab:blue"),
        ("held-out", held, "tab:orange"),
        ("rejected", {i for i, r in enumerate(fit.rejected) if r}, "tab:red"),
    )
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name, indices, colour in groups:
        mine = [p for i, p in enumerate(fit.points) if i in indices]
        measured = [p.forward_s * 1e3 for p in mine]
        predicted = [profile.forward_seconds(p.shape) * 1e3 for p in mine]
        ax.scatter(measured, predicted, s=8, alpha=0.6, color=colour, label=name)
    times = [p.forward_s * 1e3 for p in fit.points]
    lo, hi = min(times) * 0.8, max(times) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="y = x")
    ax.set(xscale="log", yscale="log", xlabel="measured forward ms", ylabel="predicted ms")
    err = fit.errors["held-out"]
    ax.set_title(f"{profile.name}: held-out median {err[0]:.1f}%, p90 {err[1]:.1f}%")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
