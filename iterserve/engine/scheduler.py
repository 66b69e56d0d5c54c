"""Iteration-level scheduler: re-decides the batch before every forward.

Each iteration has one token budget (``max_num_batched_tokens``). Running requests are
served first (decodes, then unfinished prefill chunks, each in admission order), then
waiting requests in arrival order while the budget, ``max_num_seqs`` and the KV watermark
allow. A prefill takes ``min(remaining, budget, long_prefill_token_threshold)`` tokens, so
long prompts are chunked across iterations (Sarathi-Serve, Agrawal et al., OSDI 2024). When
a running request cannot get a block, the most recently admitted request is preempted by
recompute: its blocks are freed and it re-enters the waiting queue at the front, keeping its
output tokens, which are recomputed with the prompt when it is admitted again.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from iterserve.config import SchedulerConfig
from iterserve.engine.kv_cache_manager import KVCacheManager
from iterserve.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from iterserve.engine.request import Request, RequestStatus


class Scheduler:
    """Owns the waiting and running queues; the only code that changes a request's state.

    Args:
        config: scheduler settings.
        kv_cache_manager: the block manager (owned by this scheduler from now on).
        max_model_len: tokens per sequence, resolved from the model.
    """

    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._finished_since_last_step: list[str] = []
        # Requests the scheduler itself ended (pool too small), reported by update_from_output.
        self._capacity_finished: list[Request] = []
        self._admit_counter = itertools.count()
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue changes

    def add_request(self, request: Request) -> None:
        """Queue a validated request (see ``LLMEngine.add_request`` for the checks)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort): free their blocks now. Unknown ids are ignored."""
        done = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            done.append(request)
        return done

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop all KV, keep the tokens, go back to the front."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- one iteration

    def schedule(self) -> SchedulerOutput:
        """Choose this iteration's batch and reserve its KV slots."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request_id -> num_scheduled_tokens, in batch order
        preempted: list[Request] = []

        # Decodes first so that a long prefill never delays running streams.
        for request in sorted(self.running, key=lambda r: (self._is_prefill(r), r.admit_seq)):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                if len(self.running) == 1:
                    # Alone and still out of blocks: the pool cannot hold this sequence.
                    self._finish_capacity(request)
                    break
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                budget += scheduled.pop(victim.request_id, 0)
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                scheduled[request.request_id] = num_new
                budget -= num_new

        if not preempted:
            budget = self._admit_waiting(budget, scheduled)

        out = self._build_output(scheduled, preempted)
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        return out

    def _admit_waiting(self, budget: int, scheduled: dict[str, int]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = self.kv.get_computed_blocks(request)
            num_computed = len(hits) * self.kv.block_size
            remaining = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = self._num_new_tokens(request, num_computed, budget)
            nothing_running = not self.running
            if not self.kv.allocate_slots(
                request, num_new, hits, use_watermark=not nothing_running
            ):
                if nothing_running:
                    # Every block is free and it still does not fit: it never will.
                    self.waiting.popleft()
                    self._finish_capacity(request, queued=True)
                    continue
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            request.admit_seq = next(self._admit_counter)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
        return budget

    def _finish_capacity(self, request: Request, queued: bool = False) -> None:
        if not queued:
            self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
        self._capacity_finished.append(request)

    def _is_prefill(self, request: Request) -> bool:
        return request.num_tokens - request.num_computed_tokens > 1

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0 and num_new > 1:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def _build_output(self, scheduled: dict[str, int], preempted: list[Request]) -> SchedulerOutput:
        batch = []
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            batch.append(
                ScheduledRequest(
                    request_id=request_id,
                    token_ids=request.all_token_ids[start : start + num_new],
                    num_computed_tokens=start,
                    block_table=self.kv.block_ids(request_id),
                    sample=start + num_new == request.num_tokens,
                    sampling_params=request.sampling_params,
                )
            )
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        return SchedulerOutput(
            scheduled=batch,
            preempted_request_ids=[r.request_id for r in preempted],
            finished_request_ids=finished,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advance progress, append sampled tokens, stop and free finished requests.

        Returns the requests that got a new token or finished in this iteration (finished
        ones carry their final status and have already given back their blocks).
        """
        updated, self._capacity_finished = self._capacity_finished, []
        for sched in scheduler_output.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted between schedule() and now
            request.num_computed_tokens += sched.num_scheduled_tokens
            self.kv.cache_full_blocks(request)
            if not sched.sample:
                continue
            request.append_output_token(runner_output.sampled_token_ids[sched.request_id])
            status = request.check_stop(self.max_model_len)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updated.append(request)
        return updated

    def check_integrity(self) -> None:
        """Assert the queue and block invariants (tests call this after every step)."""
        self.kv.check_integrity()
        assert {r.request_id for r in self.running} | {r.request_id for r in self.waiting} == set(
            self.requests
        )
        assert len(self.running) + len(self.waiting) == len(self.requests)
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            num_blocks = len(self.kv.block_ids(request.request_id))
            assert num_blocks >= self.kv.num_blocks_for(request.num_computed_tokens), request
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not self.kv.block_ids(request.request_id), request
