"""Shared fixtures: one float32 copy of the real default model for the whole session, and the
``device`` the device-neutral executor tests run on (CUDA when present, else the CPU).

Without a CUDA device the Triton kernels run under Triton's interpreter (on the CPU):
``TRITON_INTERPRET=1`` is set here, before any test imports triton (``@triton.jit`` reads it
when it decorates a kernel), so CI needs nothing else. With one they compile for the GPU
(unless ``TRITON_INTERPRET`` is set explicitly).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

# Under pytest-xdist the workers share the cores: each worker's torch (and every server it
# starts, which inherits the variable) gets its share of threads. Oversubscribed OpenMP pools
# spin against each other and run several times slower than the same work in turn.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(
        max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    )

import torch  # after OMP_NUM_THREADS
from helpers import SHARED_NUM_KV_BLOCKS

from iterserve.config import EngineConfig

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when present, else the CPU (as the engine's own choice, ``select_device``)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(scope="session")
def loaded_f32() -> Any:
    """The default model loaded once in float32 (parity with Hugging Face is tested there)."""
    from iterserve.executor.build import build

    # A small host pool too (swap tests): 0.05 GiB = 72 float32 blocks of 16 tokens.
    config = EngineConfig.from_kwargs(
        dtype="float32", num_kv_blocks=SHARED_NUM_KV_BLOCKS, swap_space=0.05
    )
    return build(config)


# The suite's time budget on the reference machine (2 cores): `make test` prints where it
# stands at the end, beside the slowest tests.
SUITE_BUDGET_S = 12 * 60
_session_start = time.monotonic()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Whole modules per worker (module and session fixtures such as a real server or the
    loaded model are built once per worker), and the cluster tier's modules together on one
    worker, as they share one cluster (a package fixture)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/cluster/"):
                return "tests/cluster"
            return str(super()._split_scope(nodeid))

    return ModuleScheduling(config, log)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or config.option.collectonly:  # nothing ran here
        return
    elapsed_s = time.monotonic() - _session_start
    verdict = "within" if elapsed_s <= SUITE_BUDGET_S else "OVER"
    terminalreporter.write_sep(
        "=",
        f"suite time {elapsed_s:.0f} s: {verdict} the budget of {SUITE_BUDGET_S} s",
        bold=True,
        red=verdict == "OVER",
        green=verdict == "within",
    )
