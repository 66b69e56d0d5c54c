"""The engine process's telemetry rows: one ``scheduler_iterations`` row per iteration.

The engine runs on an injected clock (virtual time in the simulator) and reads no clock of its
own; ``recorded_at`` is the wall clock (UTC) when the engine loop hands the iterations over,
read here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from iterserve.telemetry.schema import utc_iso
from iterserve.telemetry.writer import TelemetryWriter

if TYPE_CHECKING:
    from iterserve.engine.messages import IterationStats

TABLE = "scheduler_iterations"


class IterationRecorder:
    """Queues ``scheduler_iterations`` rows on a writer of its own.

    Args:
        path: the SQLite file.
    """

    def __init__(self, path: str) -> None:
        self.writer = TelemetryWriter(path)

    def record(self, first_iteration_id: int, iterations: Sequence[IterationStats]) -> int:
        """Queue a row per :class:`~iterserve.engine.messages.IterationStats` (numbered from
        ``first_iteration_id``); never blocks. Returns the rows dropped so far."""
        recorded_at = utc_iso(time.time())
        submit = self.writer.submit
        for i, it in enumerate(iterations):
            submit(
                TABLE,
                (
                    first_iteration_id + i,
                    recorded_at,
                    it.num_decode_tokens,
                    it.num_prefill_tokens,
                    it.num_scheduled_seqs,
                    it.num_free_blocks,
                    it.latency_s * 1000,
                ),
            )
        return self.writer.num_dropped[TABLE]

    def close(self) -> None:
        self.writer.close()
