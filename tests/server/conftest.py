from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from server_utils import ADMIN_TOKEN, API_KEY, Server, free_port, run_server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """One float32 server on the real model, shared by the tests that need the model (tests
    that retune it restore it); it publishes KV events on ``s.kv_events_port``."""
    with run_server(
        "--dtype", "float32",
        "--num-kv-blocks", "256",
        "--max-num-seqs", "32",
        "--api-key", API_KEY,
        "--admin-token", ADMIN_TOKEN,
        "--kv-events-port", str(free_port()),
    ) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The default model's tokenizer (the fake engine's outputs are its tokens' texts)."""
    from transformers import AutoTokenizer

    from iterserve.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir("default")))
