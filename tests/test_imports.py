"""The control plane must stay free of torch (small images); the top-level API is lazy."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "iterserve",
        "iterserve.router",
        "iterserve.operator",
        "iterserve.operator.handlers",
        "iterserve.operator.main",
        "iterserve.router.server",
        "iterserve.engine.scheduler",
        # The simulator: simulated replicas and the what-if replay run in the control image.
        "iterserve.sim.replica",
        "iterserve.sim.simulate",
    ],
)
def test_import_does_not_load_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lazy_top_level_names() -> None:
    import iterserve
    from iterserve.engine.sampling_params import SamplingParams

    assert iterserve.SamplingParams is SamplingParams
    with pytest.raises(AttributeError):
        _ = iterserve.NoSuchThing  # type: ignore[attr-defined]
