"""The per-step message of tensor parallelism: what the driver sends each worker.

A request's block table goes in full the first time a rank sees it (or after it was
preempted), then per step only the tokens to compute and the blocks appended since, with the
finished and preempted ids and the swaps. Workers never sample, so they need no prompt, no
sampling parameters and no generated text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from iterserve.engine.outputs import ScheduledRequest, SchedulerOutput
from iterserve.engine.sampling_params import SamplingParams


class ScheduledDelta(NamedTuple):
    """One request's share of an iteration, as a worker needs it (a tuple on the wire).

    ``blocks`` is the whole block table when ``full_table`` is set, else the blocks appended
    to the table the worker holds for ``request_id``.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    blocks: list[int]
    full_table: bool
    sample: bool


@dataclass(frozen=True)
class StepMessage:
    """What every worker gets per iteration (``shutdown``: stop instead)."""

    scheduled: list[ScheduledDelta] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    shutdown: bool = False


class StepEncoder:
    """The driver's side: turns each :class:`SchedulerOutput` into a :class:`StepMessage`,
    remembering the block table each worker holds per request."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def encode(self, out: SchedulerOutput) -> StepMessage:
        tables = self.tables
        for request_id in (*out.finished_request_ids, *out.preempted_request_ids):
            tables.pop(request_id, None)
        scheduled = []
        for s in out.scheduled:
            table = s.block_table
            known = tables.get(s.request_id)
            n = len(known) if known is not None else 0
            if known is not None and len(table) >= n and table[:n] == known:
                blocks, full = table[n:], False
                known.extend(blocks)
            else:  # new to the workers, or its blocks changed (preempted and resumed)
                blocks, full = list(table), True
                tables[s.request_id] = list(table)
            scheduled.append(
                ScheduledDelta(
                    s.request_id, s.token_ids, s.num_computed_tokens, blocks, full, s.sample
                )
            )
        return StepMessage(
            scheduled,
            out.finished_request_ids,
            out.preempted_request_ids,
            out.blocks_to_swap_out,
            out.blocks_to_swap_in,
        )


class StepDecoder:
    """A worker's side: rebuilds the :class:`SchedulerOutput` of each :class:`StepMessage`."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self._params = SamplingParams()  # workers do not sample: any params do

    def decode(self, msg: StepMessage) -> SchedulerOutput:
        tables = self.tables
        for request_id in (*msg.finished_request_ids, *msg.preempted_request_ids):
            tables.pop(request_id, None)
        scheduled = []
        for d in msg.scheduled:
            if d.full_table:
                table = tables[d.request_id] = list(d.blocks)
            else:
                table = tables[d.request_id]
                table.extend(d.blocks)
            scheduled.append(
                ScheduledRequest(
                    d.request_id,
                    d.token_ids,
                    d.num_computed_tokens,
                    list(table),
                    d.sample,
                    self._params,
                )
            )
        return SchedulerOutput(
            scheduled=scheduled,
            preempted_request_ids=msg.preempted_request_ids,
            finished_request_ids=msg.finished_request_ids,
            blocks_to_swap_out=msg.blocks_to_swap_out,
            blocks_to_swap_in=msg.blocks_to_swap_in,
        )
