"""The operator's live push (:func:`iterserve.operator.push.sync_pods`, what every reconcile
runs) on two real ``iterserve serve`` replicas while they stream: no stream fails or loses a
token, and both replicas end on the desired settings.

The replicas are simulated (the real server, scheduler and KV manager over the cpu-smollm2
latency profile): what the push meets is the HTTP admin API and the engine's settings swap
between iterations. The real model under a live change is tests/server/test_real_model.py's."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from server_utils import free_port, run_server, stream_completion, write_secret_volume

from iterserve.operator.push import PodTarget, pods_refusing, sync_pods
from iterserve.operator.spec import desired_settings, parse_spec, settings_hash_of

TOKEN = "admin-secret"
MAX_TOKENS = 48
SPEC: dict[str, Any] = {
    "model": {"name": "smol", "source": {"hostPath": "/models/smol"}},
    "image": "iterserve:test",
    "resources": {"gpus": 0},
    "engine": {"swapSpace": 0},
    "scheduler": {
        "maxNumSeqs": 8,
        "maxNumBatchedTokens": 256,
        "chunkSize": 64,
        "maxWaitingPerTenant": 4,
    },
    "slaTiers": [{"name": "premium", "priority": 0}, {"name": "batch", "priority": 5}],
}


def test_a_live_push_under_streaming_load_loses_nothing() -> None:
    flags = ("--simulate", "cpu-smollm2", "--num-kv-blocks", "128", "--admin-token", TOKEN)
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(stack.enter_context, run_server(*flags)) for _ in range(2)]
        servers = [s.result() for s in starting]
        desired = desired_settings(parse_spec(SPEC))
        desired_hash = settings_hash_of(desired)

        async def main() -> None:
            async with httpx.AsyncClient(timeout=300) as http:
                clients = [httpx.AsyncClient(base_url=s.url, timeout=300) for s in servers]
                body = {"prompt": "Tell me a story about", "max_tokens": MAX_TOKENS}
                streams = [
                    asyncio.create_task(stream_completion(c, {**body, "ignore_eos": True}))
                    for c in clients
                    for _ in range(3)
                ]
                # Push once every replica is decoding its three streams.
                for s in servers:
                    while (await http.get(s.url + "/load")).json()["num_running"] < 3:
                        await asyncio.sleep(0.02)
                targets = [PodTarget(f"pod-{i}", s.url) for i, s in enumerate(servers)]
                results = await sync_pods(targets, desired, desired_hash, 7, TOKEN, 30.0)
                assert all(r.pushed and r.applied and r.error is None for r in results), results
                assert [r.version for r in results] == [7, 7]
                done = await asyncio.gather(*streams)
                assert all(d.status == 200 and not d.errors for d in done), done
                assert [d.completion_tokens for d in done] == [MAX_TOKENS] * 6
                for s in servers:
                    load = (await http.get(s.url + "/load")).json()
                    assert (load["config_hash"], load["config_version"]) == (desired_hash, 7)
                # Again: every pod already runs the settings, nothing is pushed.
                again = await sync_pods(targets, desired, desired_hash, 7, TOKEN, 30.0)
                assert all(r.applied and not r.pushed for r in again)
                for c in clients:
                    await c.aclose()

        asyncio.run(main())


def test_a_push_during_an_admin_token_rotation_falls_back_to_the_previous_token(
    tmp_path: Path,
) -> None:
    """A replica on ``--admin-port`` with its token in a Secret-volume file: the operator has
    written ``NEW\\nOLD`` but the kubelet has not refreshed the pod's file yet (it holds OLD):
    the push with NEW gets 401 and succeeds with OLD; once the file is swapped, NEW works."""
    token_file = write_secret_volume(tmp_path, "old-token\n", 1)
    admin_port = free_port()
    flags = ("--simulate", "cpu-smollm2", "--num-kv-blocks", "64", "--admin-port",
             str(admin_port), "--admin-token-file", str(token_file))  # fmt: skip
    first = desired_settings(parse_spec(SPEC))
    second = desired_settings(parse_spec({**SPEC, "scheduler": {**SPEC["scheduler"],
                                                                "maxNumSeqs": 6}}))  # fmt: skip
    rotated = ("new-token", "old-token")
    with run_server(*flags) as server:
        pod = PodTarget("pod-0", server.url, f"http://127.0.0.1:{admin_port}")

        async def main() -> None:
            alone = await sync_pods([pod], first, settings_hash_of(first), 2, "new-token")
            assert alone[0].error is not None and alone[0].error.startswith("401"), alone
            assert await pods_refusing([pod], "new-token") == ["pod-0"]
            (during,) = await sync_pods([pod], first, settings_hash_of(first), 2, rotated)
            assert during.pushed and during.applied and during.version == 2, during
            write_secret_volume(tmp_path, "new-token\nold-token\n", 2)  # the kubelet's swap
            assert await pods_refusing([pod], "new-token") == []
            (after,) = await sync_pods([pod], second, settings_hash_of(second), 3, rotated)
            assert after.pushed and after.applied and after.version == 3, after

        asyncio.run(main())
