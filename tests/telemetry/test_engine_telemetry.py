"""``scheduler_iterations`` written by the engine process itself (``ProcessEngine`` with
``telemetry_db``, the path ``iterserve serve`` takes), on the fake runner's engine in a child
process: one row per iteration with the iteration's exact token counts."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from helpers import collect

from iterserve.engine.process_engine import ProcessEngine
from iterserve.engine.sampling_params import SamplingParams


def test_the_engine_process_writes_one_row_per_iteration(tmp_path: Path) -> None:
    db = tmp_path / "t.db"

    async def main() -> int:
        engine = ProcessEngine(
            {}, factory="engine_fakes:build_fragile_engine", telemetry_db=str(db)
        )
        await engine.start()
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            _, out = await collect(engine, "a", [5, 6, 7], params)
            assert out.finished
            load = await engine.query_load()
            return load.num_free_blocks
        finally:
            await engine.stop()  # the child closes its writer: every row is written

    num_free_blocks = asyncio.run(main())
    rows = (
        sqlite3.connect(db)
        .execute(
            "SELECT iteration_id, num_prefill_tokens, num_decode_tokens, batch_size, "
            "free_kv_blocks, iteration_latency_ms FROM scheduler_iterations ORDER BY rowid"
        )
        .fetchall()
    )
    # The prompt's 3 tokens (first token sampled), then 3 decodes of 1 token.
    assert [r[:4] for r in rows] == [(1, 3, 0, 1), (2, 0, 1, 1), (3, 0, 1, 1), (4, 0, 1, 1)]
    assert rows[-1][4] == num_free_blocks  # freed at the end of the last iteration
    assert all(r[5] >= 0 for r in rows)
