"""The router in front of a real replica (the default model) and a simulated one: the real
replica's own /load under real work steers new requests away from it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from router_utils import pool_of, router, until
from server_utils import run_server
from sim_profiles import make_profile, write_profile

pytestmark = pytest.mark.model


def test_a_busy_real_replica_gets_no_new_requests(tmp_path: Path) -> None:
    profile = write_profile(tmp_path / "profile.json", make_profile(fixed_s=0.02))
    with (
        run_server("--num-kv-blocks", "256", "--max-model-len", "2048") as real,
        run_server(
            "--simulate", str(profile), "--served-model-name", "SmolLM2-135M-Instruct"
        ) as sim,
    ):

        async def run() -> None:
            # Generous staleness: a busy 2-core machine can delay a poll past 500 ms.
            flags = ("--backend", real.url, "--backend", sim.url, "--no-prefix-affinity")
            flags += ("--stale-after-ms", "5000")
            async with router(*flags) as (url, app), httpx.AsyncClient(timeout=120) as http:
                pool = pool_of(app)
                await until(lambda: len(pool.ready()) == 2, "both ready", 30)
                body = {
                    "prompt": "Tell me a long story. " * 20,
                    "max_tokens": 400,
                    "ignore_eos": True,
                }
                loaders = [
                    asyncio.create_task(http.post(real.url + "/v1/completions", json=body))
                    for _ in range(4)
                ]
                state = pool.backends[real.url].state
                await until(
                    lambda: state.report is not None and state.report.num_running == 4,
                    "the real replica reports its four requests",
                    60,
                )
                sim_state = pool.backends[sim.url].state
                routed: set[str] = set()
                for i in range(4):
                    # A poll that lands while a probe is open can leave it counted as in flight
                    # at the simulated replica until the next poll (50 ms; longer on a loaded
                    # CI machine), and in-flight requests outweigh the real replica's KV usage:
                    # wait it out, the subject here is KV pressure.
                    await until(lambda: sim_state.in_flight_since_report == 0, "sim reported", 30)
                    answer = await http.post(
                        url + "/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 2}
                    )
                    routed.add(answer.headers["x-routed-to"])
                assert routed == {sim.url}
                for t in loaders:
                    t.cancel()
                # The disconnected loaders' requests are aborted: the real replica empties.
                await until(lambda: state.report.num_running == 0, "aborted", 30)

        asyncio.run(run())
