"""``python -m benchmarks.gpu`` on a CPU: every section end to end on tiny shapes (Triton under its
interpreter), run as the lent GPU machine runs it (``python -m benchmarks.gpu``) behind an
import blocker that fails any import of iterserve's that machine could not satisfy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu
from benchmarks.gpu_kernels import SectionFailed

HERE = Path(__file__).parent
ROOT = HERE.parent.parent

TINY_ARGS = [
    "--device", "cpu", "--quick", "--dtype", "float32", "--attention-backend", "triton",
    "--attention-shapes", "2x32", "--attention-geometry", "4:2:64",
    "--llama-shape", "64:2:4:2:128:512", "--num-requests", "4", "--prompt-len", "16",
    "--output-len", "8", "--decode-batch", "4", "--decode-context", "32", "--decode-steps", "4",
    "--parity-requests", "6", "--parity-tokens", "4", "--copy-mib", "1",
]  # fmt: skip

# Installs the blocker, runs the script as ``python -m`` would, and reports what was blocked.
_RUNNER = """
import json, runpy, sys
sys.path.insert(0, {here!r})
import import_blocker
blocker = import_blocker.install()
sys.argv = ["benchmarks.gpu", *{args!r}]
try:
    runpy.run_module("benchmarks.gpu", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as e:
    code = e.code
print("BLOCKED " + json.dumps(sorted({{m for m, _ in blocker.blocked}})))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu")
    args = [*TINY_ARGS, "--output-dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER.format(here=str(HERE), args=args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    blocked_line = next(
        (line for line in proc.stdout.splitlines() if line.startswith("BLOCKED ")), None
    )
    assert blocked_line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {
        "returncode": proc.returncode,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "blocked": json.loads(blocked_line.removeprefix("BLOCKED ")),
        "report": json.loads((out / "gpu-quick.json").read_text()),
    }


def test_imports_only_what_the_lent_machine_has(tiny_run: dict[str, Any]) -> None:
    assert tiny_run["blocked"] == [], tiny_run["blocked"]


def test_every_section_runs_on_a_cpu(tiny_run: dict[str, Any]) -> None:
    assert tiny_run["returncode"] == 0, tiny_run["stderr"][-3000:]
    sections = tiny_run["report"]["sections"]
    assert {n: e["status"] for n, e in sections.items()} == dict.fromkeys(
        gpu.SECTIONS.values(), "ok"
    )
    assert [sections[n]["section"] for n in gpu.SECTIONS.values()] == [1, 2, 3, 4, 5]

    assert tiny_run["report"]["triton_preflight"]["ok"] is True
    assert "Triton does not run here" not in tiny_run["report"].get("note", "")
    kernels = sections["kernel_checks"]["result"]
    assert (kernels["num_checks"], kernels["num_failed"]) == (9, 0)  # no bfloat16 on a CPU

    attention = sections["attention_bandwidth"]["result"]
    assert attention["shape"]["num_kv_heads"] == 2 and attention["copy_bandwidth_gb_s"] > 0
    (row,) = attention["rows"]
    assert (row["batch"], row["context"]) == (2, 32) and row["bandwidth_gb_s"] > 0
    assert row["vs_copy"] > 0 and attention["target_ratio"] is None  # no 64x2048 row

    offline = sections["offline_throughput"]["result"]
    for engine in ("iterserve", "transformers"):
        assert offline[engine]["generated_tokens"] == 4 * 8
        assert offline[engine]["tokens_per_s"] > 0
    assert offline["ratio"] > 0 and offline["model"]["platform"] == "triton"
    assert offline["transformers"]["timed_out"] is False
    assert offline["first_token_agreement"] == 1.0  # float32, same weights

    floor = sections["decode_floor"]["result"]
    assert (floor["batch"], floor["num_steps"]) == (4, 4)
    assert floor["iteration_ms"] > 0 and floor["floor_ms"] > 0 and floor["vs_floor"] > 0
    assert floor["kv_bytes_read"] > 0 and floor["weight_bytes_read"] > 0

    parity = sections["engine_parity"]["result"]
    assert parity["num_mismatches"] == 0 and parity["backend"] == "triton"
    recompute, swap = parity["runs"]["recompute"], parity["runs"]["swap"]
    assert recompute["counters"]["device"]["preemptions_recompute"] > 0
    assert swap["counters"]["device"]["preemptions_swap"] > 0
    assert recompute["counters"]["device"]["prefix_cache_hit_tokens"] > 0
    assert recompute["num_completions"] == 8  # 6 requests, 2 of them n=2

    for name in gpu.SECTIONS.values():
        assert f"] {name} (ok" in tiny_run["stdout"]  # the table


def test_blocker_fails_a_foreign_import_from_iterserve() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import import_blocker; "
        "import_blocker.install(); "
        "exec('import httpx', {'__name__': 'iterserve.bench.fake'})"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1 and "httpx is not on the lent GPU machine" in proc.stderr


def test_a_failing_section_keeps_its_error_and_partial_result() -> None:
    def fails() -> dict[str, Any]:
        raise SectionFailed("2 checks failed", {"num_failed": 2})

    entry = gpu.run_section(fails)
    assert entry["status"] == "failed" and entry["result"] == {"num_failed": 2}
    assert "SectionFailed" in entry["traceback"]
    crash = gpu.run_section(lambda: {"x": 1 // 0})
    assert crash["status"] == "failed" and "ZeroDivisionError" in crash["error"]


def test_main_exits_1_when_a_section_fails(tmp_path: Path) -> None:
    # 3 query heads over 2 KV heads: the kernel's launcher rejects the shape.
    overrides = ["--sections", "2", "--attention-geometry", "3:2:64"]
    args = gpu._parser().parse_args([*TINY_ARGS, *overrides, "--output-dir", str(tmp_path)])
    assert gpu.main(args) == 1
    report = json.loads((tmp_path / "gpu-quick.json").read_text())
    entry = report["sections"]["attention_bandwidth"]
    assert entry["status"] == "failed" and "multiple of num_kv_heads" in entry["error"]
    assert list(report["sections"]) == ["attention_bandwidth"]


def test_a_failed_triton_preflight_runs_the_model_sections_on_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A machine where Triton cannot build its launcher (no C compiler): `auto` falls back.
    from benchmarks import gpu_kernels

    def no_triton(device: Any) -> dict[str, Any]:
        error = "RuntimeError('Failed to find C compiler')"
        return {"ok": False, "error": error, "seconds": 0.0, "c_compiler": None, "python_h": True}

    monkeypatch.setattr(gpu_kernels, "triton_preflight", no_triton)
    tiny = [a if a != "triton" else "auto" for a in TINY_ARGS]
    args = gpu._parser().parse_args([*tiny, "--sections", "5", "--output-dir", str(tmp_path)])
    assert gpu.main(args) == 0
    report = json.loads((tmp_path / "gpu-quick.json").read_text())
    assert report["triton_preflight"]["ok"] is False
    assert "sections 3-5 use --attention-backend torch" in report["note"]
    assert report["sections"]["engine_parity"]["result"]["backend"] == "torch"


def test_transformers_stops_at_its_timeout_without_finishing_the_requests() -> None:
    import threading

    import torch

    from benchmarks.gpu_models import LlamaShape, llama_config, random_hf_llama
    from benchmarks.gpu_transformers import transformers_throughput

    cpu = torch.device("cpu")
    hf = random_hf_llama(llama_config(LlamaShape(64, 2, 4, 2, 128, 512), 64), torch.float32, cpu, 0)
    forwards = []
    hf.model.register_forward_hook(lambda *_: forwards.append(1))
    before = threading.active_count()
    # A zero timeout: leaving the manager's context (a flushing stop) would run all 40 steps.
    result = transformers_throughput(hf, [[1, 2, 3]] * 4, 40, 0.0, cpu)
    assert result["timed_out"] is True and result["early_stop"] == "done"
    assert len(forwards) < 40, len(forwards)
    assert threading.active_count() == before
