"""``bench quantization``'s own logic without servers: the tables' ratios against bfloat16 and
llama.cpp, the plot, the prompts, the flags. (The rows themselves are measured by hand:
docs/benchmarks.md; the kernels and the modes are tested in tests/kernels and
tests/executor.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from iterserve.bench.common import quantization_mode
from iterserve.bench.quantization import find_llama_server, format_tables, plot, prompts
from iterserve.cli import build_parser


def _run(tps: float) -> dict[str, Any]:
    return {"output_tokens_per_s": tps, "ttft_ms": {"p50": 100.0}, "tpot_ms": {"p50": 20.0}}


def _results() -> dict[str, Any]:
    return {
        "cpu": "CPU: Test; avx512_vnni; 2 cores",
        "args": {"concurrency": [1, 32]},
        "quality": [
            {"mode": "none", "perplexity": 20.0, "agreement": None},
            {
                "mode": "int8",
                "perplexity": 21.0,
                "agreement": {"exact": 0.5, "prefix": 0.75, "first_token": 0.9},
            },
        ],
        "online": {
            "none": {1: _run(30.0), 32: _run(200.0)},
            "int8": {1: _run(45.0), 32: _run(350.0)},
            "llama.cpp": {1: _run(40.0), 32: _run(70.0)},
        },
        "offline": {"none": {"output_tokens_per_s": 170.0}, "int8": {"output_tokens_per_s": 320.0}},
        "plans": {"int8": "int8: int8 at every batch size (ms for all linears, ...)"},
    }


def test_the_tables_give_each_engine_its_ratios(tmp_path: Path) -> None:
    text = format_tables(_results())
    assert text.startswith("CPU: Test; avx512_vnni")
    assert "int8          21.000   0.50    0.75   0.90" in text
    int8 = next(line for line in text.splitlines() if line.startswith("int8 ") and "c=1" in line)
    assert "c=32:  350.0 (1.75x, 5.00x)" in int8 and "c=1:   45.0 (1.50x, 1.12x)" in int8
    assert "int8         320.0 (1.88x)" in text
    assert "bf16          20.000   1.00" in text  # bf16 by that name in every table
    assert "plan of the int8 server: int8: int8 at every batch size" in text
    # read back from the JSON (concurrencies as strings) the same table comes out
    again = json.loads(json.dumps(_results()))
    assert format_tables(again) == text
    plot(again, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 1000


def test_prompts_are_distinct_and_about_the_asked_length() -> None:
    texts = prompts(16, 64, seed=3)
    assert len(set(texts)) == 16 and all(len(t) == 256 for t in texts)
    assert prompts(16, 64, seed=3) == texts and find_llama_server("none") is None


def test_a_mode_names_the_weights_and_the_kv_cache() -> None:
    assert quantization_mode("int8") == ("int8", "auto")
    assert quantization_mode("kv8") == ("none", "int8")
    assert quantization_mode("q4+kv8") == quantization_mode("kv8+q4") == ("q4", "int8")
    for bad in ("int8+q4", "kv8+kv8", "int4", ""):
        with pytest.raises(ValueError, match="a mode is"):
            quantization_mode(bad)
    args = build_parser().parse_args(["bench", "quantization", "--modes", "kv8,int8+kv8"])
    assert args.modes == ["kv8", "int8+kv8"]


@pytest.mark.parametrize(
    "flags",
    [["--modes", "fp8"], ["--modes", "int8+q4"], ["--concurrency", "0"], ["--concurrency", "x"]],
)
def test_bad_flags_are_refused(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "quantization", *flags])
    assert exit_info.value.code == 2
    assert "quantization: error" in capsys.readouterr().err


def test_smoke_is_a_tiny_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--smoke`` sizes every step down (it only moved the output directory before: a full
    run of an hour on a loaded machine); the steps themselves are replaced here."""
    from iterserve.bench import quantization

    seen: list[tuple[str, Any]] = []

    def online(mode: str, args: Any, out: Path) -> dict[int, dict[str, Any]]:
        seen.append((mode, args))
        (out / f"server-{mode}.log").write_text("")  # the plan is read from the server's log
        return {c: _run(10.0) for c in args.concurrency}

    monkeypatch.setattr(quantization, "quality_rows", lambda args: seen.append(("q", args)) or [])
    monkeypatch.setattr(quantization, "iterserve_online", online)
    monkeypatch.setattr(quantization, "offline_throughput", lambda m, a: {"output_tokens_per_s": 1})
    flags = ["bench", "quantization", "--smoke", "--output-dir", str(tmp_path)]
    args = build_parser().parse_args(flags)
    assert args.func(args) == 0
    assert [mode for mode, _ in seen] == ["q", "none", "int8+kv8"]
    for _, used in seen:
        assert (used.concurrency, used.prompt_len, used.output_len) == ([1], 32, 8)
        assert (used.quality_prompts, used.llama_server) == (2, "none")
    assert (tmp_path / "quantization.json").is_file()
