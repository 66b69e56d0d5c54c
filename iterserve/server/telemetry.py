"""The HTTP process's telemetry rows (``--telemetry-db``): ``sequences`` when a request ends,
``scheduler_config`` for each applied version (docs/server.md, "Telemetry records").

Rows go through a :class:`~iterserve.telemetry.writer.TelemetryWriter`, so a request's end
costs a tuple and a ``put_nowait``. Times measured on the server's monotonic clock become UTC
through the wall clock's offset at the moment of writing.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict

from iterserve.config import LIVE_SCHEDULER_KEYS, EngineConfig, SchedulerConfig
from iterserve.engine.messages import RequestDelta
from iterserve.server.metrics import RequestTracker
from iterserve.telemetry.schema import utc_iso
from iterserve.telemetry.writer import TelemetryWriter

# finish reason of the request's first completion -> sequences.status
_STATUS = {"stop": "finished", "length": "finished", "abort": "aborted", "error": "error"}


class ServerTelemetry:
    """Builds and queues the HTTP process's rows.

    Args:
        writer: the started writer (owned: :meth:`close` closes it).
        engine_config: the engine's settings (``gpu_memory_utilization``, ``block_size``).
        model_version: the served model id.
        clock: the server's monotonic clock (arrival times, token times, the engine's
            ``first_scheduled_time``).
    """

    def __init__(
        self,
        writer: TelemetryWriter,
        engine_config: EngineConfig,
        model_version: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.writer = writer
        self.engine_config = engine_config
        self.model_version = model_version
        self.clock = clock

    def record_config(self, version: int, config: SchedulerConfig) -> None:
        """One ``scheduler_config`` row: the settings of ``version``, applied now."""
        self.writer.submit(
            "scheduler_config",
            (
                version,
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.long_prefill_token_threshold,
                self.engine_config.cache.gpu_memory_utilization,
                config.kv_watermark,
                utc_iso(time.time()),
                json.dumps([asdict(t) for t in config.tiers]),
                json.dumps(
                    {k: getattr(config, k) for k in LIVE_SCHEDULER_KEYS if k != "tiers"},
                    sort_keys=True,
                ),
            ),
        )

    def record_sequence(
        self,
        seq_id: str,
        request_id: str,
        tenant_id: str,
        num_prompt_tokens: int,
        max_output_tokens: int,
        tracker: RequestTracker,
        last_delta: RequestDelta | None,
        reason: str,
    ) -> None:
        """One ``sequences`` row for an engine request that ended with ``reason``
        (stop/length/abort/error); ``last_delta`` is the last delta it received."""
        offset = time.time() - self.clock()  # monotonic -> epoch seconds
        first_scheduled = last_delta.first_scheduled_time if last_delta else None
        final = last_delta if last_delta is not None and last_delta.finished else None
        ttft_ms = tpot_ms = None
        if tracker.first_token is not None:
            ttft_ms = (tracker.first_token - tracker.arrival) * 1000
        if tracker.token_gaps:
            tpot_ms = statistics.median(tracker.token_gaps) * 1000
        self.writer.submit(
            "sequences",
            (
                seq_id,
                request_id,
                tenant_id,
                tracker.tier,
                num_prompt_tokens,
                max_output_tokens,
                sum(tracker.num_tokens_by_index.values()),
                final.num_computed_tokens if final else 0,
                _STATUS.get(reason, reason),
                final.num_preemptions if final else 0,
                final.num_kv_blocks if final else 0,
                utc_iso(tracker.arrival + offset),
                None if first_scheduled is None else utc_iso(first_scheduled + offset),
                utc_iso(time.time()),
                ttft_ms,
                tpot_ms,
                self.model_version,
            ),
        )

    def close(self) -> None:
        self.writer.close()
