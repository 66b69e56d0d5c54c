"""The wheel a checkout builds (``pip install .``, ``pip wheel .``) holds the package only: the
one-off studies of ``benchmarks/`` stay in the repository, and none of them comes back inside
``iterserve/bench/`` (which keeps what users run: serve, offline, gate, calibrate, fidelity)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def test_the_wheel_holds_no_one_off_benchmark(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    junk = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("iterserve", "benchmarks"):
        shutil.copytree(REPO / name, src / name, ignore=junk)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    dist = tmp_path / "dist"
    subprocess.run([*pip_wheel, "-w", str(dist), str(src)], check=True, capture_output=True)
    (wheel,) = dist.glob("iterserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    assert {n.split("/")[0] for n in names} == {
        "iterserve",
        wheel.name.split("-py")[0] + ".dist-info",
    }
    studies = {p.name for p in BENCHMARKS.glob("*.py")} - {"__init__.py", "cli_args.py"}
    assert {"gpu.py", "soak.py", "overload.py", "router.py", "decode.py"} <= studies
    assert {f"iterserve/bench/{name}" for name in studies} & names == set()
    assert {"iterserve/bench/serve.py", "iterserve/bench/gate.py"} <= names
