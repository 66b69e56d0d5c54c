"""A disconnect storm (docs/reliability.md, "Disconnect storm"): 1,000 streams whose clients
hang up at random points, while their requests wait, prefill (long prompts in 64-token chunks)
or decode. Afterwards every KV block is free (``GET /load``), nothing is left in the engine,
its client or the server, and the server's tasks and memory are what they were after a
warm-up round.

Over a simulated replica in this process (the real scheduler and KV manager behind
``AsyncEngine``, the cpu-smollm2 latency profile run 5x faster), over real HTTP on loopback;
in-process so that the test can count the server's tasks and objects exactly.
"""

from __future__ import annotations

import asyncio
import collections
import gc
from typing import Any

import httpx
import psutil
from fake_engine import serve_in_process, until

from benchmarks.reliability import disconnect_storm
from iterserve.config import ServerConfig
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.request import RequestStatus
from iterserve.server.generation import GenerationRun
from iterserve.sim.profile import load_profile
from iterserve.sim.replica import ScaledClock, build_simulated_engine

NUM_STREAMS = 1000
NUM_WARM_UP = 200
CONCURRENCY = 48  # clients at once: 8 seats, so most wait
ENGINE_KWARGS = {
    "num_kv_blocks": 128,  # 2,048 tokens: long prompts contend for blocks too
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,  # a 600-token prompt prefills over 10 iterations
    "max_model_len": 2048,
}


def simulated_replica() -> tuple[AsyncEngine, collections.Counter[str]]:
    """The engine client, and a count of the states its aborted requests were in
    (``waiting``, ``prefill``, ``decode``), taken as the scheduler frees them."""
    clock = ScaledClock(5.0)
    engine, tokenizer = build_simulated_engine(
        load_profile("cpu-smollm2"), ENGINE_KWARGS, clock.sleep, clock
    )
    aborted_in: collections.Counter[str] = collections.Counter()
    finish_requests = engine.scheduler.finish_requests

    def counting(request_ids: Any, status: RequestStatus) -> Any:
        if status == RequestStatus.FINISHED_ABORTED:
            for request_id in request_ids:
                r = engine.scheduler.requests.get(request_id)
                if r is None:
                    continue
                if r.status != RequestStatus.RUNNING:
                    aborted_in["waiting"] += 1
                elif r.num_computed_tokens < r.num_prompt_tokens:
                    aborted_in["prefill"] += 1
                else:
                    aborted_in["decode"] += 1
        return finish_requests(request_ids, status)

    engine.scheduler.finish_requests = counting  # type: ignore[method-assign]
    client = AsyncEngine(engine)
    client.tokenizer = tokenizer  # type: ignore[attr-defined]  # serve_in_process's
    return client, aborted_in


def num_live_objects() -> int:
    gc.collect()
    return sum(type(o) is GenerationRun for o in gc.get_objects())


def test_a_disconnect_storm_leaves_every_block_free_and_nothing_behind() -> None:
    client, aborted_in = simulated_replica()
    process = psutil.Process()

    async def settled(http: httpx.AsyncClient) -> dict[str, Any]:
        async def idle() -> bool:
            load = (await http.get("/load")).json()
            return load["num_running"] == load["num_waiting"] == 0

        for _ in range(500):
            if await idle():
                break
            await asyncio.sleep(0.01)
        await until(lambda: not client._streams and not client._live, "engine streams closed")
        load: dict[str, Any] = (await http.get("/load")).json()
        return load

    async def main() -> None:
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with (
            serve_in_process(client, ServerConfig()) as url,
            httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http,
        ):
            await disconnect_storm(http, NUM_WARM_UP, CONCURRENCY, seed=1)
            await settled(http)
            num_tasks, rss = len(asyncio.all_tasks()), process.memory_info().rss
            aborted_in.clear()

            outcomes = await disconnect_storm(http, NUM_STREAMS, CONCURRENCY, seed=2)
            load = await settled(http)
            assert load["num_free_blocks"] == load["num_total_blocks"]
            assert load["num_running"] == load["num_waiting"] == load["num_swapped"] == 0
            assert len(asyncio.all_tasks()) == num_tasks
            assert num_live_objects() == 0
            rss_growth_mib = (process.memory_info().rss - rss) / 2**20
            print(f"outcomes {dict(outcomes)}; aborted in {dict(aborted_in)}; ", end="")
            print(f"tasks {num_tasks}; RSS growth {rss_growth_mib:.1f} MiB")
            assert rss_growth_mib < 32
            # The storm hit every state (hundreds of hang-ups; a few hundred run to the end).
            assert sum(outcomes.values()) == NUM_STREAMS
            assert outcomes["left before a token"] > 100 and outcomes["left after tokens"] > 100
            assert min(aborted_in[s] for s in ("waiting", "prefill", "decode")) >= 10

    asyncio.run(main())
    engine = client.engine
    engine.scheduler.check_integrity()
    assert not engine.scheduler.requests
