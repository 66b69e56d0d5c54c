from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_utils import ADMIN_TOKEN, API_KEY, Server, run_server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """One float32 server shared by the API tests (tests that retune it restore it)."""
    with run_server(
        "--dtype", "float32",
        "--num-kv-blocks", "256",
        "--max-num-seqs", "32",
        "--api-key", API_KEY,
        "--admin-token", ADMIN_TOKEN,
    ) as s:  # fmt: skip
        yield s
