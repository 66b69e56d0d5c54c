"""The built-in profile ``a100x4-llama3-70b`` against the figures it was derived from.

Expected values are the totals of tables (a) and (b) of the facts file
(``docs/profiles/a100-tp4-70b-facts.md``, from Vidur's A100 data), plus the 0.35 ms
of LM head the profile adds to every step. The held-out (leave-one-out) figures the profile and
docs/simulator.md state are recomputed here by the script that derives the profile.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from iterserve.sim.profile import BatchShape, LatencyProfile, load_profile, profile_path

NAME = "a100x4-llama3-70b"
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "derive_a100_profile.py"
DOCS = ROOT / "docs" / "simulator.md"
LM_HEAD_MS = 0.35
BOUND_PCT = 10.0  # every checked table row; held out, the profile states median 2.35%, p90 7.2%
HBM_BYTES_PER_S = 4 * 2.04e12  # four A100 80GB SXM4
WEIGHT_BYTES = 141e9  # Llama-3-70B in bfloat16


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return load_profile(NAME)


@pytest.fixture(scope="module")
def script() -> Iterator[ModuleType]:
    """``scripts/derive_a100_profile.py`` as a module (it is not in a package)."""
    spec = importlib.util.spec_from_file_location("derive_a100_profile", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def decode(batch: int, context: int) -> BatchShape:
    return BatchShape(
        num_decode_tokens=batch, decode_context_tokens=batch * context, num_seqs=batch
    )


def prefill(num_tokens: int) -> BatchShape:
    pairs = num_tokens * (num_tokens + 1) / 2
    return BatchShape(num_prefill_tokens=num_tokens, prefill_attention_pairs=pairs, num_seqs=1)


def test_model_and_kv_geometry(profile: LatencyProfile) -> None:
    assert profile.name == NAME
    assert profile.model.tensor_parallel_size == 4
    assert profile.model.num_layers == 80
    assert profile.model.dtype == "bfloat16"
    assert profile.model.max_model_len == 8192
    assert profile.model.vocab_size == 128256
    assert profile.model.eos_token_ids == [128001, 128009]
    # 80 layers x (K, V) x 8 KV heads x head_dim 128 x 2 bytes
    assert profile.kv_cache.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2 == 327680
    assert profile.kv_cache.block_size == 16
    assert profile.kv_cache.num_blocks == 27340
    assert profile.swap_seconds(1) == pytest.approx(16 * 327680 / 12e9)


@pytest.mark.parametrize(
    ("shape", "facts_ms"),
    [
        (decode(128, 2048), 60.1),
        (decode(128, 1024), 53.2),
        (decode(64, 2048), 47.7),
        (decode(1, 1024), 37.6),
        (prefill(1024), 230.8),
        (prefill(4096), 845.3),
    ],
)
def test_predicts_table_rows(profile: LatencyProfile, shape: BatchShape, facts_ms: float) -> None:
    predicted_ms = profile.forward_seconds(shape) * 1e3
    assert predicted_ms == pytest.approx(facts_ms + LM_HEAD_MS, rel=BOUND_PCT / 100)


def test_states_its_held_out_fit_error(profile: LatencyProfile, script: ModuleType) -> None:
    """Leave-one-out over 10 decode + 4 prefill rows: 14 folds of 13, each row held out once."""
    fit = profile.source.fit_error
    assert fit is not None
    assert (fit.num_train, fit.num_held_out) == (13, 14)
    assert 0 < fit.median_abs_pct <= fit.p90_abs_pct <= BOUND_PCT
    _, columns = script.derive()
    median, p90 = columns["NVSwitch"].summary(held_out=True)
    assert (fit.median_abs_pct, fit.p90_abs_pct) == (round(median, 2), round(p90, 2))
    assert "leave-one-out" in profile.source.method
    in_sample = columns["NVSwitch"].summary(held_out=False)
    assert in_sample[1] < p90  # held out is the harder figure on these points


def test_docs_show_the_tables_the_script_computes(script: ModuleType) -> None:
    """Every row of docs/simulator.md's A100 tables is what ``--check`` prints now."""
    _, columns = script.derive()
    docs = DOCS.read_text().splitlines()
    rows = script.markdown_rows(columns["NVSwitch"]) + script.markdown_summary(columns)
    assert len(rows) == 2 + 14 + 2 + 6
    assert [row for row in rows if row not in docs] == []


def test_a_held_out_prediction_never_sees_its_own_point(script: ModuleType) -> None:
    points = script.table_points()
    totals = [p.nvswitch_ms for p in points]
    _, base = script.fidelity(points, totals)
    for idx in (4, 10):  # decode B=128 ctx=1024, prefill N=512
        moved = list(totals)
        moved[idx] *= 1.5
        _, fid = script.fidelity(points, moved)
        assert fid.held_out_ms[idx] == base.held_out_ms[idx]
        assert fid.in_sample_ms[idx] != base.in_sample_ms[idx]
        # the in-sample fit bends towards the outlier; held out, the full distance shows
        assert fid.abs_pct(held_out=True)[idx] > fid.abs_pct(held_out=False)[idx] > 20


def test_leave_one_out_recovers_an_exact_model(script: ModuleType) -> None:
    """Totals made by the model form itself are predicted held out to the rounding (4 digits)."""
    fixed, floor, per_decode, per_prefill, per_ctx, per_pair = 24.0, 14.0, 0.15, 0.2, 6e-5, 1e-5
    points = []
    totals = []
    for point in script.table_points():
        shape = point.shape
        attention = per_ctx * shape.decode_context_tokens + per_pair * shape.prefill_attention_pairs
        linear = per_decode * shape.num_decode_tokens + per_prefill * shape.num_prefill_tokens
        totals.append(fixed + max(floor, linear) + attention)
        points.append(dataclasses.replace(point, attention_ms=attention))
    _, fid = script.fidelity(points, totals)
    assert max(fid.abs_pct(held_out=True)) < 0.05
    assert fid.published_ms == [t + LM_HEAD_MS for t in totals]


def test_check_refuses_a_profile_that_differs(
    script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / f"{NAME}.json"
    out.write_text(profile_path(NAME).read_text())
    assert script.main(["--check", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| decode B=128 ctx=2048 |" in printed and "matches the derivation" in printed
    out.write_text(profile_path(NAME).read_text().replace('"p90_abs_pct": 7.2', '"p90_abs_pct": 2'))
    assert script.main(["--check", "--out", str(out)]) == 1
    assert "differs from what the script derives" in capsys.readouterr().err
    assert script.main(["--check", "--out", str(tmp_path / "missing.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert script.main(["--out", str(tmp_path / "no-dir" / "a.json")]) == 1
    assert "cannot write" in capsys.readouterr().err


def test_decode_at_128_is_above_the_physical_floor(profile: LatencyProfile) -> None:
    """The design's ~16 ms at 128 decodes is below what reading the weights and the KV takes."""
    kv_bytes = 128 * 2048 * profile.kv_cache.kv_bytes_per_token
    floor_s = (WEIGHT_BYTES + kv_bytes) / HBM_BYTES_PER_S
    assert floor_s == pytest.approx(0.0278, abs=0.001)  # ~17 ms weights + ~10 ms KV
    predicted_s = profile.forward_seconds(decode(128, 2048))
    assert predicted_s > floor_s > 0.016


def test_decode_is_flat_until_the_weight_read_floor_is_passed(profile: LatencyProfile) -> None:
    small = [profile.forward_seconds(decode(b, 1)) for b in (1, 8, 32, 64)]
    assert max(small) - min(small) < 1e-5
    assert profile.forward_seconds(decode(128, 1)) > small[-1] + 0.005


def test_engine_overhead_is_vidurs_cpu_profile(profile: LatencyProfile) -> None:
    assert profile.overhead_seconds(BatchShape(num_seqs=8)) == pytest.approx(1.2e-3, rel=1e-3)
    assert profile.overhead_seconds(BatchShape(num_seqs=128)) == pytest.approx(5.8e-3, rel=1e-3)


def test_script_reproduces_the_builtin(
    script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / f"{NAME}.json"
    assert script.main(["--out", str(out)]) == 0
    assert "decode B=128 ctx=2048" in capsys.readouterr().out
    assert out.read_text() == profile_path(NAME).read_text()
