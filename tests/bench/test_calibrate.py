"""``iterserve bench calibrate``: the smoke run on the real engine writes a valid profile; on
synthetic points (no model), outliers are rejected, the noise is reported, cells that do not
fit are re-measured then dropped or kept, and a profile over the bound is refused (exit 1,
the reasons, points and plot still written) unless ``--force``."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iterserve.bench import calibrate_serving
from iterserve.bench.calibrate import calibrate, main
from iterserve.bench.calibrate_output import Measurement, Point
from iterserve.bench.calibrate_serving import Load, LoadResult, ServeCheck, fit_cpu_costs
from iterserve.cli import build_parser
from iterserve.sim.profile import BatchShape, ServingCosts, load_profile
from iterserve.workload.stats import RequestRecord


@pytest.mark.model
def test_smoke_calibration_writes_profile_points_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "cpu-test.json"
    # --force: on a machine shared with other work the smoke grid may miss the bound; the
    # profile is then written with the reasons as a warning (checked below).
    args = _args(tmp_path, "--smoke", "--repeats", "2", "--out", str(out), "--force", serve=True)
    result = calibrate(args)
    assert result.profile_path == out

    profile = load_profile(out)
    assert profile.name == "cpu-test"  # from --out's stem
    assert profile.model.name == "SmolLM2-135M-Instruct" and profile.model.dtype == "bfloat16"
    assert profile.model.num_layers == 30 and profile.model.vocab_size == 49152
    # 30 layers x (K, V) x 3 KV heads x 64 dims x 2 bytes; the pool the default 1 GiB holds.
    assert profile.kv_cache.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2
    assert profile.kv_cache.num_blocks == (1 << 30) // (16 * profile.kv_cache.kv_bytes_per_token)
    assert profile.swap.bytes_per_s > 0
    err = profile.source.fit_error
    assert err is not None and err.num_train > 0 and err.num_held_out > 0
    assert math.isfinite(err.median_abs_pct) and math.isfinite(err.p90_abs_pct)
    assert all(v >= 0 for v in profile.iteration.model_dump().values())
    assert all(v >= 0 for v in profile.engine_overhead.model_dump().values())
    it = profile.iteration
    # Prefill costs something; which of its terms carries it is the fit's (on a tiny grid,
    # with the noise of a shared machine, per token, per chunk or per attention pair).
    assert it.fixed_s > 0
    assert it.per_prefill_token_s + it.per_prefill_seq_s + it.per_attention_pair_s > 0
    assert any(n.startswith("noise (spread of repeats") for n in profile.source.notes)
    assert bool(result.refused) == profile.source.notes[0].startswith("WARNING")

    document = json.loads((tmp_path / "points.json").read_text())
    points = document["points"]
    # Fitted: neither rejected as an outlier nor of a cell dropped or re-measured.
    kept = [p for p in points if not p["rejected"] and not p["dropped"]]
    assert len(kept) == err.num_train + err.num_held_out
    assert sum(p["held_out"] for p in points) == err.num_held_out
    assert {p["repeat"] for p in points} == {0, 1}  # the warm-up (-1) is not a point
    # Decode-only, prefill-only and mixed iterations were all measured.
    kinds = {(p["num_decode_tokens"] > 0, p["num_prefill_tokens"] > 0) for p in points}
    assert kinds == {(True, False), (False, True), (True, True)}
    # The arrival cell: one fresh prompt per iteration beside the earlier ones' decodes.
    arrivals = [p for p in points if p["cell"] == "arrival l48"]
    assert arrivals and all(p["num_prefill_seqs"] <= 1 for p in arrivals)
    assert any(p["num_prefill_seqs"] == 1 and p["num_decode_tokens"] >= 2 for p in arrivals)
    assert all(p["total_s"] >= p["forward_s"] > 0 for p in points)
    fitted_or_rejected = [p for p in points if not p["dropped"]]  # the noise's points
    assert document["noise"]["num_shapes"] > 0
    assert document["noise"]["num_points"] == len(fitted_or_rejected)
    assert (tmp_path / "fit.png").stat().st_size > 1000
    # The serve stage ran a real server: the HTTP side's costs, its notes and its log.
    serving = profile.serving
    assert serving.cpu_per_iteration_s + serving.cpu_per_token_s + serving.cpu_per_request_s > 0
    assert serving.request_latency_s >= 0
    assert any(n.startswith("serve stage: ") for n in profile.source.notes)
    assert any(n.startswith("serve stage check, 8 requests") for n in profile.source.notes)
    assert (tmp_path / "server.log").stat().st_size > 0


# ----------------------------------------------------------------- synthetic measurements

TRUE = load_profile("cpu-smollm2")


def _args(tmp_path: Path, *flags: str, serve: bool = False) -> argparse.Namespace:
    """``bench calibrate`` flags; synthetic points skip the serve stage unless ``serve``."""
    serve_flags = [] if serve else ["--no-serve"]
    argv = ["bench", "calibrate", "--output-dir", str(tmp_path), *serve_flags, *flags]
    return build_parser().parse_args(argv)


def _cells() -> dict[str, list[BatchShape]]:
    """Decode cells (batch x context, 6 decode steps each) and prefill cells (chunks)."""
    cells = {}
    for batch in (1, 4, 16):
        for context in (128, 512):
            cells[f"decode b{batch} c{context}"] = [
                BatchShape(batch, 0, batch * (context + step), 0.0, batch) for step in range(6)
            ]
    for chunk in (32, 128):
        cells[f"prefill p{chunk}"] = [
            BatchShape(0, chunk, 0, chunk * offset + chunk * (chunk + 1) / 2, 1)
            for offset in range(0, 512, chunk)
        ]
    return cells


def _points(
    cell: str, shapes: list[BatchShape], seed: int, noise: float = 0.01, slow: float = 1.0
) -> list[Point]:
    """3 repeats of ``shapes`` at the true profile's time x ``slow``, lognormal ``noise``."""
    rng = np.random.default_rng(seed)
    return [
        Point(cell, s, TRUE.forward_seconds(s) * slow * rng.lognormal(0, noise), 0, repeat)
        for repeat in range(3)
        for s in shapes
    ]


def _total(points: list[Point]) -> list[Point]:
    return [Point(p.cell, p.shape, p.forward_s, p.forward_s + 2e-4, p.repeat) for p in points]


def _measurement(
    special: dict[str, list[Point]] | None = None,
    remeasure: Callable[[str], list[Point]] | None = None,
) -> Measurement:
    points: list[Point] = []
    for i, (cell, shapes) in enumerate(_cells().items()):
        points += (special or {}).get(cell) or _points(cell, shapes, seed=i)
    base = TRUE.model_copy(update={"name": "cpu-synthetic"})
    return Measurement(base, _total(points), "synthetic grid", 3, [], remeasure)


def test_hiccups_are_rejected_and_the_profile_is_written(tmp_path: Path) -> None:
    m = _measurement()
    for i in range(0, len(m.points), 17):  # another process took the cores: 20x slower
        m.points[i].forward_s *= 20
    result = calibrate(_args(tmp_path, "--out", str(tmp_path / "p.json")), m)
    assert result.refused == [] and result.profile_path == tmp_path / "p.json"
    assert result.fit.noise.num_rejected == len(range(0, len(m.points), 17))
    assert all(result.fit.rejected[i] for i in range(0, len(m.points), 17))
    err = result.profile.source.fit_error
    assert err is not None and err.median_abs_pct < 3  # the true model, 1% noise
    coef = result.profile.iteration
    assert coef.fixed_s == pytest.approx(TRUE.iteration.fixed_s, rel=0.1)
    notes = result.profile.source.notes
    assert any("noise" in n and f"{result.fit.noise.num_rejected} of" in n for n in notes)
    assert result.fit.noise.median_pct < 3
    assert load_profile(tmp_path / "p.json") == result.profile


def test_a_cell_the_model_cannot_fit_is_remeasured_kept_and_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # decode b16 c128 measures 4x the model, consistently (repeats agree): not noise.
    shapes = _cells()["decode b16 c128"]
    asked: list[str] = []

    def remeasure(cell: str) -> list[Point]:
        asked.append(cell)
        return _points(cell, shapes, seed=99, slow=4.0)

    m = _measurement(
        {"decode b16 c128": _points("decode b16 c128", shapes, 7, slow=4.0)}, remeasure
    )
    args = _args(tmp_path, "--out", str(tmp_path / "p.json"))
    assert main(args, m) == 1
    assert asked == ["decode b16 c128"]
    assert not (tmp_path / "p.json").exists()  # refused: not written
    assert (tmp_path / "points.json").exists() and (tmp_path / "fit.png").stat().st_size > 1000
    err = capsys.readouterr().err
    assert "profile refused, not written" in err and "--force" in err
    assert "cell decode b16 c128: error" in err and "> 30%" in err  # twice the bound
    assert "noise (spread of repeats" in err and "load average" in err
    document = json.loads((tmp_path / "points.json").read_text())
    assert any("decode b16 c128" in r for r in document["refused"])
    cell = next(c for c in document["cells"] if c["cell"] == "decode b16 c128")
    assert cell["median_pct"] > 15 and cell["noise_pct"] < 5


def test_force_writes_a_refused_profile_with_a_warning(tmp_path: Path) -> None:
    shapes = _cells()["decode b16 c128"]
    m = _measurement({"decode b16 c128": _points("decode b16 c128", shapes, 7, slow=4.0)})
    result = calibrate(_args(tmp_path, "--force"), m)
    assert result.refused and result.profile_path == tmp_path / "profile.json"
    written = load_profile(result.profile_path)
    assert written.source.notes[0].startswith("WARNING: written with --force")
    assert "decode b16 c128" in written.source.notes[0]
    assert any(n.startswith("kept cell decode b16 c128") for n in written.source.notes)
    # A looser bound accepts the same points without --force.
    loose = calibrate(_args(tmp_path / "loose", "--max-held-out-error-pct", "500"), m)
    assert loose.refused == [] and loose.profile_path is not None


def test_a_cell_slow_in_two_repeats_is_remeasured_and_accepted(tmp_path: Path) -> None:
    # Two of three repeats under contention: the median is off, rejection cannot help.
    shapes = _cells()["decode b4 c512"]
    bad = _points("decode b4 c512", shapes, 5)
    for p in bad:
        if p.repeat > 0:
            p.forward_s *= 3 + p.repeat
    m = _measurement({"decode b4 c512": bad}, lambda cell: _points(cell, _cells()[cell], seed=42))
    result = calibrate(_args(tmp_path), m)
    assert result.refused == [] and result.profile_path is not None
    assert result.notes == ["re-measured once (error > 15%): decode b4 c512"]
    assert result.notes[0] in result.profile.source.notes
    assert all(c.median_pct < 5 for c in result.fit.cells)


def test_a_cell_still_noisy_after_remeasuring_is_dropped(tmp_path: Path) -> None:
    shapes = _cells()["decode b1 c512"]

    def noisy(cell: str, seed: int = 8) -> list[Point]:
        points = _points(cell, shapes, seed)
        for p in points:  # every repeat a different multiple: a loaded machine
            p.forward_s *= (1, 3, 9)[p.repeat]
        return points

    m = _measurement({"decode b1 c512": noisy("decode b1 c512")}, noisy)
    result = calibrate(_args(tmp_path), m)
    assert result.refused == [] and result.profile_path is not None
    assert "decode b1 c512" not in {c.cell for c in result.fit.cells}
    assert any(n.startswith("dropped cell decode b1 c512") for n in result.notes)
    assert "decode b1 c512: dropped (too noisy)" in m.skipped
    # Its points, first measurement and re-measurement, stay in points.json for diagnosis.
    rows = json.loads((tmp_path / "points.json").read_text())["points"]
    dropped = [r for r in rows if r["dropped"]]
    assert dropped and {r["cell"] for r in dropped} == {"decode b1 c512"}
    # 6 shapes x 3 repeats, measured and re-measured; none of them fitted.
    assert len(dropped) == 2 * 6 * 3
    assert all(r["dropped"] for r in rows if r["cell"] == "decode b1 c512")


def test_bad_flags_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for flags, message in (
        (["--repeats", "0"], "must be >= 1"),
        (["--max-held-out-error-pct", "-1"], "must be a number > 0"),
        (["--arrival-lengths", "64,abc"], "--arrival-lengths: not an integer: 'abc'"),
        (["--arrival-lengths", "1"], "--arrival-lengths: must be >= 2, got 1"),
        (["--chunk-sizes", "-5"], "--chunk-sizes: must be >= 2"),
        (["--batch-sizes", "0"], "--batch-sizes: must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "calibrate", *flags])
        assert message in capsys.readouterr().err
    # Empty lists are no cells of that kind.
    args = build_parser().parse_args(["bench", "calibrate", "--arrival-lengths=", "--no-serve"])
    assert args.arrival_lengths == "" and args.no_serve


def test_a_cell_over_the_bound_but_within_twice_it_is_kept_not_refused(tmp_path: Path) -> None:
    # 25% slower, repeats agreeing: re-measured (over 15%), kept (not noise), and within the
    # per-cell limit of twice the bound, so the profile is written.
    shapes = _cells()["prefill p32"]
    m = _measurement(
        {"prefill p32": _points("prefill p32", shapes, 3, slow=1.25)},
        lambda cell: _points(
            cell, _cells()[cell], seed=4, slow=1.25 if cell == "prefill p32" else 1
        ),
    )
    result = calibrate(_args(tmp_path), m)
    assert result.refused == [] and result.profile_path is not None
    # The prefill slope is shared: the fit splits the difference between p32 and p128.
    assert result.notes[0].startswith("re-measured once (error > 15%): prefill p")
    kept = [n for n in result.notes if n.startswith("kept cell prefill p")]
    assert kept and not any(n.startswith("dropped") for n in result.notes)
    assert all(c.judged_pct <= 30 for c in result.fit.cells)
    assert max(c.median_pct for c in result.fit.cells) > 15


def test_too_few_shapes_to_fit_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shape = _cells()["decode b1 c128"][0]
    m = Measurement(TRUE, _total(_points("decode b1 c128", [shape], 0)), "one shape", 3)
    assert main(_args(tmp_path), m) == 1
    assert "cannot fit a profile: 1 distinct shapes: too few to hold some out" in (
        capsys.readouterr().err
    )


def test_serve_stage_costs_go_into_the_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def measure_serving(profile: Any, model: str, dtype: str, smoke: bool, log: Path) -> Any:
        calls.append((profile.iteration.fixed_s > 0, model, dtype, smoke, log))
        costs = ServingCosts(
            cpu_per_iteration_s=1e-3,
            cpu_per_token_s=4e-4,
            cpu_per_request_s=2e-3,
            request_latency_s=0.01,
        )
        check = ServeCheck(0.030, 0.032, 0.200, 0.190)  # within 2x and 4x the bound
        return costs, ["serve stage: found"], check

    monkeypatch.setattr(calibrate_serving, "measure_serving", measure_serving)
    out = tmp_path / "p.json"
    result = calibrate(_args(tmp_path, "--out", str(out), serve=True), _measurement())
    assert calls == [(True, "default", "auto", False, tmp_path / "server.log")]
    profile = load_profile(out)
    assert profile.serving.cpu_per_token_s == 4e-4 and profile.serving.request_latency_s == 0.01
    assert profile.source.notes[-1] == "serve stage: found" and not result.refused


def test_a_failed_serve_stage_refuses_the_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def measure_serving(*args: Any) -> Any:
        raise RuntimeError("serve stage, concurrent load: 1 of 24 requests failed (500: boom)")

    monkeypatch.setattr(calibrate_serving, "measure_serving", measure_serving)
    out = tmp_path / "p.json"
    assert main(_args(tmp_path, "--out", str(out), serve=True), _measurement()) == 1
    assert not out.exists()
    err = capsys.readouterr().err
    assert "serve stage failed (RuntimeError: serve stage, concurrent load: 1 of 24" in err
    # The grid's fit is kept, so that a failed stage does not cost the grid again.
    grid_only = load_profile(tmp_path / "profile-grid-only.json")
    assert grid_only.serving == ServingCosts() and grid_only.iteration.fixed_s > 0
    assert "--max-held-out-error-pct" not in err  # the bound is not the reason
    forced = calibrate(_args(tmp_path, "--out", str(out), "--force", serve=True), _measurement())
    assert forced.profile_path == out and forced.refused
    assert load_profile(out).source.notes[0].startswith("WARNING: written with --force")


def test_cpu_costs_are_fitted_over_the_loads() -> None:
    def load(num_requests: int, tokens_each: int, num_iterations: int) -> LoadResult:
        spec = Load("x", num_requests, 16, tokens_each, 1)
        records = [RequestRecord(ok=True, output_tokens=tokens_each) for _ in range(num_requests)]
        tokens = num_requests * tokens_each
        cpu = num_iterations * 1e-3 + tokens * 3e-4 + num_requests * 4e-3
        return LoadResult(spec, [], records, cpu, tokens, num_iterations)

    loads = [load(8, 8, 72), load(24, 48, 150), load(16, 2, 3)]
    per_iteration, per_token, per_request = fit_cpu_costs(loads)
    assert per_iteration == pytest.approx(1e-3)
    assert per_token == pytest.approx(3e-4) and per_request == pytest.approx(4e-3)
    # CPU that falls as the tokens grow: no negative cost.
    loads[1].cpu_s = loads[0].cpu_s / 2
    assert all(c >= 0 for c in fit_cpu_costs(loads))
    with pytest.raises(ValueError, match="three costs need three loads"):
        fit_cpu_costs(loads[:2])


@pytest.mark.parametrize(
    ("check", "reason"),
    [
        (ServeCheck(0.030, 0.045, 0.2, 0.2), "TPOT p50 45.0 ms simulated, 30.0 ms measured (+50%"),
        (ServeCheck(0.030, 0.030, 0.2, 0.35), "TTFT p50 350.0 ms simulated, 200.0 ms measured"),
    ],
)
def test_a_serve_stage_check_far_off_refuses_the_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check: ServeCheck, reason: str
) -> None:
    monkeypatch.setattr(
        calibrate_serving, "measure_serving", lambda *args: (ServingCosts(), [], check)
    )
    result = calibrate(
        _args(tmp_path, "--out", str(tmp_path / "p.json"), serve=True), _measurement()
    )
    assert result.profile_path is None
    assert any(r.startswith("serve stage check: ") and reason in r for r in result.refused)


def test_a_grid_mostly_too_noisy_is_refused(tmp_path: Path) -> None:
    """Every cell but one measured during contention (repeats spread 20-60%, errors far over
    the bound): they are dropped, and a profile fitted on the one left is refused."""
    rng = np.random.default_rng(7)
    special = {}
    for i, (cell, shapes) in enumerate(_cells().items()):
        if cell == "decode b1 c128":
            continue
        points = _points(cell, shapes, seed=i, noise=0.01)
        special[cell] = [
            Point(p.cell, p.shape, p.forward_s * (1 + 3 * rng.random()), 0, p.repeat)
            for p in points
        ]
    result = calibrate(_args(tmp_path, "--out", str(tmp_path / "p.json")), _measurement(special))
    assert any(r.startswith("only ") and " cells kept" in r for r in result.refused), result.refused
    assert result.profile_path is None
