"""What ``iterserve bench calibrate`` makes of its measured points: the fitted profile (fit
on a seeded 80%, error on the other 20%), the error table, ``points.json`` and the plot."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from iterserve.config import DEFAULT_MODEL_NAME
from iterserve.sim.fit import (
    OUTLIER_ABS_PCT,
    fit_engine_overhead,
    fit_iteration_model,
    split_held_out,
)
from iterserve.sim.profile import (
    BatchShape,
    FitError,
    KVCacheSpec,
    LatencyProfile,
    ModelSpec,
    ProfileSource,
    SwapSpec,
    abs_pct_errors,
    median_and_p90,
)

HELD_OUT_FRACTION = 0.2


@dataclass
class Point:
    """One measured iteration (seconds)."""

    cell: str
    shape: BatchShape
    forward_s: float
    total_s: float

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.forward_s


@dataclass
class Measurement:
    """Everything a calibration run measured on its loaded model."""

    loaded: Any  # iterserve.executor.build.LoadedModel
    model: str  # as given to --model
    points: list[Point]
    swap_bytes_per_s: float
    grid: str  # the cells, in words
    skipped: list[str] = field(default_factory=list)


def build_profile(
    m: Measurement, name: str | None, seed: int
) -> tuple[LatencyProfile, list[int], dict[str, tuple[float, float]]]:
    """Fit on the train split; (profile, held-out indices, {split: (median %, p90 %)}).

    ``name`` None: ``<device>-<model name>``."""
    points, loaded = m.points, m.loaded
    train, held_out = split_held_out(len(points), HELD_OUT_FRACTION, seed)
    shapes = [points[i].shape for i in train]
    iteration = fit_iteration_model(shapes, [points[i].forward_s for i in train])
    overhead = fit_engine_overhead(
        [s.num_seqs for s in shapes], [points[i].overhead_s for i in train]
    )
    hf = loaded.hf_config
    dtype = str(loaded.runner.model.embed_tokens.weight.dtype).removeprefix("torch.")
    model_name = DEFAULT_MODEL_NAME if m.model == "default" else loaded.model_dir.name
    device = loaded.runner.device.type
    draft = LatencyProfile(
        name=name or f"{device}-{model_name.lower()}",
        model=ModelSpec(
            name=model_name,
            max_model_len=int(loaded.config.model.max_model_len),
            vocab_size=int(hf.vocab_size),
            eos_token_ids=sorted(loaded.eos_token_ids),
            num_layers=int(hf.num_hidden_layers),
            dtype=dtype,
        ),
        iteration=iteration,
        engine_overhead=overhead,
        kv_cache=KVCacheSpec(
            block_size=loaded.config.cache.block_size,
            num_blocks=loaded.num_kv_blocks,
            kv_bytes_per_token=loaded.runner.kv_cache.bytes_per_token,
        ),
        swap=SwapSpec(bytes_per_s=m.swap_bytes_per_s),
        source=ProfileSource(hardware=_hardware(device), date="", method=""),
    )
    predicted = [draft.forward_seconds(p.shape) for p in points]
    errors = {
        split: median_and_p90(
            abs_pct_errors([predicted[i] for i in idx], [points[i].forward_s for i in idx])
        )
        for split, idx in (("held-out", held_out), ("train", train))
    }
    num_dropped = sum(
        abs(predicted[i] - points[i].forward_s) > OUTLIER_ABS_PCT / 100 * points[i].forward_s
        for i in train
    )
    source = draft.source.model_copy(
        update={
            "date": datetime.date.today().isoformat(),
            "method": (
                f"iterserve bench calibrate: {model_name} in {dtype} on the real engine, "
                f"{m.grid}; every iteration's forward (execute_model) timed; NNLS fit weighted "
                f"by 1/measured on a seeded {1 - HELD_OUT_FRACTION:.0%} of the iterations, "
                f"error on the other {HELD_OUT_FRACTION:.0%}"
            ),
            "fit_error": FitError(
                median_abs_pct=errors["held-out"][0],
                p90_abs_pct=errors["held-out"][1],
                num_train=len(train),
                num_held_out=len(held_out),
            ),
            "references": ["Vidur (Agrawal et al., MLSys 2024)"],
            "notes": [
                f"train error: median {errors['train'][0]:.1f}%, p90 {errors['train'][1]:.1f}%",
                f"{num_dropped} train iterations are off by > {OUTLIER_ABS_PCT:.0f}% (the fit "
                "leaves such points out of its refit: hiccups of a shared machine)",
                "held-out points are random iterations: neighbours of each are in the train set",
                f"load average at the end: {os.getloadavg()[0]:.2f}",
                *[f"skipped {s}" for s in m.skipped],
            ],
        }
    )
    return draft.model_copy(update={"source": source}), held_out, errors


def _hardware(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def report(profile: LatencyProfile, points: list[Point], held_out: list[int], errors: Any) -> str:
    """The fit-error table, the coefficients, and the error per cell (all points)."""
    lines = [f"{'':16}{'held-out':>10}{'train':>10}"]
    lines.append(f"{'points':16}{len(held_out):>10}{len(points) - len(held_out):>10}")
    lines.append(f"{'median |err| %':16}{errors['held-out'][0]:>10.1f}{errors['train'][0]:>10.1f}")
    lines.append(f"{'p90 |err| %':16}{errors['held-out'][1]:>10.1f}{errors['train'][1]:>10.1f}")
    lines.append("forward model (seconds):")
    lines += [f"  {k:22} {v:.4g}" for k, v in profile.iteration.model_dump().items()]
    o = profile.engine_overhead
    lines.append(f"engine overhead: {o.fixed_s * 1e3:.3f} ms + {o.per_seq_s * 1e6:.1f} us/seq")
    lines.append(f"swap: {profile.swap.bytes_per_s / 1e9:.2f} GB/s")
    lines.append(f"{'cell':22}{'points':>7}{'median %':>10}{'p90 %':>8}{'forward ms':>12}")
    for cell in dict.fromkeys(p.cell for p in points):
        mine = [p for p in points if p.cell == cell]
        pred = [profile.forward_seconds(p.shape) for p in mine]
        med, p90 = median_and_p90(abs_pct_errors(pred, [p.forward_s for p in mine]))
        ms = statistics.median(p.forward_s for p in mine) * 1e3
        lines.append(f"{cell:22}{len(mine):>7}{med:>10.1f}{p90:>8.1f}{ms:>12.1f}")
    return "\n".join(lines)


def save_points(
    profile: LatencyProfile, points: list[Point], held_out: list[int], path: Path
) -> None:
    """Every point, its prediction and whether it was held out (JSON)."""
    held = set(held_out)
    rows = [
        {"cell": p.cell, **asdict(p.shape), "forward_s": p.forward_s, "total_s": p.total_s}
        | {"predicted_s": profile.forward_seconds(p.shape), "held_out": i in held}
        for i, p in enumerate(points)
    ]
    path.write_text(json.dumps({"profile": profile.name, "points": rows}, indent=1) + "\n")


def plot(profile: LatencyProfile, points: list[Point], held_out: list[int], path: Path) -> None:
    """Predicted vs measured forward time, log-log, train and held-out in two colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held = set(held_out)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name, keep, colour in (("train", False, "tab:blue"), ("held-out", True, "tab:orange")):
        mine = [p for i, p in enumerate(points) if (i in held) == keep]
        measured = [p.forward_s * 1e3 for p in mine]
        predicted = [profile.forward_seconds(p.shape) * 1e3 for p in mine]
        ax.scatter(measured, predicted, s=8, alpha=0.6, color=colour, label=name)
    times = [p.forward_s * 1e3 for p in points]
    lo, hi = min(times) * 0.8, max(times) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="y = x")
    ax.set(xscale="log", yscale="log", xlabel="measured forward ms", ylabel="predicted ms")
    err = profile.source.fit_error
    assert err is not None
    ax.set_title(
        f"{profile.name}: held-out median {err.median_abs_pct:.1f}%, p90 {err.p90_abs_pct:.1f}%"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
