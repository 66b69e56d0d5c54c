"""``iterserve bench calibrate --smoke`` measures the real engine and writes a valid profile."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from iterserve.bench.calibrate import main
from iterserve.cli import build_parser
from iterserve.sim.profile import load_profile


@pytest.mark.model
def test_smoke_calibration_writes_profile_points_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "cpu-test.json"
    args = build_parser().parse_args(
        ["bench", "calibrate", "--smoke", "--output-dir", str(tmp_path), "--out", str(out)]
    )
    assert main(args) == 0

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
    assert profile.iteration.fixed_s > 0 and profile.iteration.per_prefill_token_s > 0

    points = json.loads((tmp_path / "points.json").read_text())["points"]
    assert len(points) == err.num_train + err.num_held_out
    assert sum(p["held_out"] for p in points) == err.num_held_out
    # Decode-only, prefill-only and mixed iterations were all measured.
    kinds = {(p["num_decode_tokens"] > 0, p["num_prefill_tokens"] > 0) for p in points}
    assert kinds == {(True, False), (False, True), (True, True)}
    assert all(p["total_s"] >= p["forward_s"] > 0 for p in points)
    assert (tmp_path / "fit.png").stat().st_size > 1000
