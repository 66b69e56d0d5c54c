"""The built-in profile ``a100x4-llama3-70b`` against the figures it was derived from.

Expected values are the totals of tables (a) and (b) of the facts file
(``docs/profiles/a100-tp4-70b-facts.md``, from Vidur's A100 data), plus the 0.35 ms
of LM head the profile adds to every step.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from iterserve.sim.profile import BatchShape, LatencyProfile, load_profile, profile_path

NAME = "a100x4-llama3-70b"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "derive_a100_profile.py"
LM_HEAD_MS = 0.35
BOUND_PCT = 10.0  # every checked table row; the profile states median 1.45%, p90 2.55%
HBM_BYTES_PER_S = 4 * 2.04e12  # four A100 80GB SXM4
WEIGHT_BYTES = 141e9  # Llama-3-70B in bfloat16


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return load_profile(NAME)


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


def test_states_its_fit_error(profile: LatencyProfile) -> None:
    fit = profile.source.fit_error
    assert fit is not None
    assert fit.num_train == 14  # 10 decode rows + 4 prefill rows
    assert fit.num_held_out == 0
    assert 0 < fit.median_abs_pct <= fit.p90_abs_pct <= BOUND_PCT


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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("numpy")
    spec = importlib.util.spec_from_file_location("derive_a100_profile", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclass looks itself up there
    spec.loader.exec_module(script)
    out = tmp_path / f"{NAME}.json"
    monkeypatch.setattr(sys, "argv", ["derive_a100_profile.py", "--out", str(out)])
    script.main()
    assert "decode B=128 ctx=2048" in capsys.readouterr().out
    assert out.read_text() == profile_path(NAME).read_text()
