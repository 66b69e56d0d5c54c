"""A disconnect storm against a running replica (docs/reliability.md, "Disconnect storm").

Streams whose clients hang up at random points (uniform in [0, --max-hang-up-s]), at most
--concurrency at once, after a warm-up round of the same kind; then it waits for the replica
to be idle and prints what ``GET /load`` says, and (with --pid) how the server process's
memory, threads and open files moved between the end of the warm-up and the end of the storm.

    python -m benchmarks.disconnect_storm --url http://127.0.0.1:8000 --pid 1234 --num-streams 200

Exit code 1 when a KV block or a request is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from typing import Any

import httpx
import psutil

from benchmarks.reliability import disconnect_storm


async def storm(
    url: str, num_streams: int, concurrency: int, max_hang_up_s: float, max_words: int, seed: int
) -> collections.Counter[str]:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        return await disconnect_storm(
            http, num_streams, concurrency, seed, max_hang_up_s=max_hang_up_s, max_words=max_words
        )


def idle_load(url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        load: dict[str, Any] = httpx.get(url + "/load", timeout=10).json()
        if load["num_running"] == load["num_waiting"] == 0 or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def usage(pid: int | None) -> dict[str, float]:
    if pid is None:
        return {}
    p = psutil.Process(pid)
    return {"rss_mib": p.memory_info().rss / 2**20, "threads": p.num_threads(), "fds": p.num_fds()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--pid", type=int, help="the server process (memory, threads, files)")
    parser.add_argument("--num-streams", type=int, default=1000)
    parser.add_argument("--num-warm-up", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--max-hang-up-s", type=float, default=1.5)
    parser.add_argument("--max-prompt-words", type=int, default=150, help="~3-5 tokens each")
    args = parser.parse_args()
    run = (args.concurrency, args.max_hang_up_s, args.max_prompt_words)
    asyncio.run(storm(args.url, args.num_warm_up, *run, seed=1))
    before = (idle_load(args.url), usage(args.pid))
    started = time.monotonic()
    outcomes = asyncio.run(storm(args.url, args.num_streams, *run, seed=2))
    elapsed_s = time.monotonic() - started
    load, after = idle_load(args.url), usage(args.pid)
    report = {
        "num_streams": args.num_streams,
        "elapsed_s": round(elapsed_s, 1),
        "outcomes": dict(outcomes),
        "load_after": {k: load[k] for k in load if k.startswith("num_")},
        "server_after_warm_up": {k: round(v, 1) for k, v in before[1].items()},
        "server_after_storm": {k: round(v, 1) for k, v in after.items()},
    }
    print(json.dumps(report, indent=2))
    leaked = load["num_free_blocks"] != load["num_total_blocks"] or load["num_running"] > 0
    return 1 if leaked or load["num_waiting"] > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
