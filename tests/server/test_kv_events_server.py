"""The real server publishes KV events from its engine process: a prompt's full blocks as
BlockStored with the token ids the server tokenized (one short request on the real model);
a KV-events port in use stops the start-up with a one-line error, before the model loads."""

from __future__ import annotations

import httpx
import pytest
from kv_events_utils import Collector
from server_utils import API_KEY, ITERSERVE, Server, assert_kv_events_port_in_use_fails

from iterserve.config import DEFAULT_MODEL_NAME
from iterserve.kv_events import BlockStored, default_pod_name, prompt_block_hashes
from iterserve.server.metrics import ServerMetrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def complete(server: Server, prompt: str | list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.model
def test_the_prompts_full_blocks_are_published_with_their_tokens(server: Server) -> None:
    assert server.kv_events_port is not None
    events = Collector(server.kv_events_port)
    try:
        events.sync(lambda i: complete(server, f"warm-up {i}: " + "lorem ipsum " * 12))
        r = httpx.post(
            server.url + "/tokenize",
            json={"prompt": "The KV events of a real replica. " * 8},
            headers=AUTH,
            timeout=30,
        )
        token_ids = r.json()["tokens"]
        hashes = prompt_block_hashes(token_ids, 16)  # the server's default block size
        assert len(hashes) >= 2
        complete(server, token_ids)

        def stored() -> list[BlockStored]:
            return [e for e in events.events() if isinstance(e, BlockStored)]

        events.until(lambda: {h for e in stored() for h in e.block_hashes} >= set(hashes))
    finally:
        events.close()
    (event,) = stored()  # one prefill iteration: one event for all its full blocks
    assert event == BlockStored(
        tuple(hashes), None, tuple(token_ids[: 16 * len(hashes)]), 16, None, "GPU"
    )
    assert {m.topic for m in events.messages} == {f"kv@{default_pod_name()}@{DEFAULT_MODEL_NAME}"}


def test_a_kv_events_port_in_use_fails_before_the_model_loads() -> None:
    assert_kv_events_port_in_use_fails([*ITERSERVE, "serve"], timeout_s=120)


def test_the_dropped_batches_counter_follows_the_engines_total() -> None:
    metrics = ServerMetrics()

    def value() -> float | None:
        return metrics.registry.get_sample_value("iterserve_kv_events_dropped_total")

    assert value() == 0
    metrics.set_kv_events_dropped(3)
    metrics.set_kv_events_dropped(3)  # a scrape with no news adds nothing
    assert value() == 3
    metrics.set_kv_events_dropped(5)
    assert value() == 5
