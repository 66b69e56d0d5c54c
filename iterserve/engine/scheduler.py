"""Iteration-level scheduler: re-decides the batch before every forward.

Each iteration has one token budget (``max_num_batched_tokens``), spent in this order:

1. running requests: decodes, then unfinished prefill chunks, each in admission order;
2. swapped requests, brought back from the host pool (before any new admission);
3. waiting requests by effective priority (aging), then fair share between tenants (the
   tenant with the least service first: ``fair_share.VirtualTokenCounter``), then arrival,
   while the budget, ``max_num_seqs`` and the KV watermark allow.

A prefill takes ``min(remaining, budget, long_prefill_token_threshold)`` tokens, so long
prompts are chunked across iterations (Sarathi-Serve, Agrawal et al., OSDI 2024). When a
running request cannot get a block, a victim is preempted (``policy.select_victim``) by
recompute (blocks freed, tokens kept, recomputed on re-admission) or by swap (blocks copied
to the host pool), as ``policy.choose_preemption_mode`` decides. With
``priority_preemption_margin`` > 0, a waiting request that finds every seat or block taken
preempts running requests at least that much less urgent (``policy.priority_victims``) and is
admitted in the same iteration (docs/engine.md, "Priority preemption at admission"). With
``batching=static`` a new batch is admitted only when every request of the previous one has
finished.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Literal

from iterserve.config import SchedulerConfig
from iterserve.engine import policy
from iterserve.engine.block_pool import KVBlock
from iterserve.engine.fair_share import VirtualTokenCounter
from iterserve.engine.kv_cache_manager import KVCacheManager
from iterserve.engine.messages import Clock, monotonic_clock
from iterserve.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from iterserve.engine.request import Request, RequestStatus

# Called after a token is appended; returns True when a stop string ended the request.
StopChecker = Callable[[Request], bool]

# Why a request was preempted: a running request found no KV block (kv), or a more urgent
# waiting request found no seat or block (priority).
PreemptionReason = Literal["kv", "priority"]
PREEMPTION_MODES = ("recompute", "swap")
PREEMPTION_REASONS: tuple[PreemptionReason, ...] = ("kv", "priority")


class _Batch:
    """The decisions of one ``schedule()`` call, in batch order."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_tokens: dict[str, int] = {}
        self.preempted: list[Request] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        # Swapped back in by this batch: their copies are pending, so they are no victims.
        self.resumed: list[Request] = []
        # Admitted from the waiting queue by this batch: the queue order put them ahead of
        # whoever comes after them in it, so they are no priority victims in it either.
        self.admitted: list[Request] = []

    def add(self, request: Request, num_tokens: int) -> None:
        self.num_tokens[request.request_id] = num_tokens
        self.budget -= num_tokens

    def remove(self, request: Request) -> None:
        self.budget += self.num_tokens.pop(request.request_id, 0)


class Scheduler:
    """Owns the waiting, running and swapped queues; the only code that changes a request's
    state.

    Args:
        config: scheduler settings (replaceable between iterations: see ``update_config``).
        kv_cache_manager: the block manager (owned by this scheduler from now on).
        max_model_len: tokens per sequence, resolved from the model.
        stop_checker: checks stop strings after each appended token (the detokenizer).
        preemption_costs: measured costs for ``preemption_mode=auto``.
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        stop_checker: StopChecker | None = None,
        preemption_costs: policy.PreemptionCosts | None = None,
        clock: Clock = monotonic_clock,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.stop_checker = stop_checker
        self.preemption_costs = preemption_costs
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self.swapped: list[Request] = []  # in swap-out order
        self._finished_since_last_step: list[str] = []
        # Requests the scheduler itself ended (pool too small), reported by update_from_output.
        self._capacity_finished: list[Request] = []
        self._admit_counter = itertools.count()
        self._arrival_counter = itertools.count()
        self._static_batch_open = True
        self.iteration = 0
        # Preemptions so far by (mode, reason).
        self.num_preemptions_by_cause = {
            (mode, reason): 0 for mode in PREEMPTION_MODES for reason in PREEMPTION_REASONS
        }
        # Prompt tokens looked up in the prefix cache at admission, and those found there.
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0
        # Service per tenant (weighted tokens): the waiting order within a priority.
        self.fair_share = VirtualTokenCounter()

    def update_config(self, config: SchedulerConfig) -> None:
        """Swap in new settings; call between iterations (they apply to the next one)."""
        self.config = config
        self.kv.set_watermark(config.kv_watermark)

    # ----------------------------------------------------------------- queue changes

    def add_request(self, request: Request) -> None:
        """Queue a validated request (see ``LLMEngine.add_request`` for the checks)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.arrival_seq = next(self._arrival_counter)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.fair_share.arrived(request.tenant)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort): free their blocks now. Unknown ids are ignored."""
        done = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            queue = self._queue_of(request)
            queue.remove(request)
            if queue is self.waiting:
                self.fair_share.left_waiting(request.tenant)
            self._finish(request, status)
            done.append(request)
        return done

    def _queue_of(self, request: Request) -> list[Request]:
        if request.status == RequestStatus.RUNNING:
            return self.running
        if request.status == RequestStatus.SWAPPED:
            return self.swapped
        return self.waiting

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.kv.free_host(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)
        self.fair_share.left_engine(request.tenant)

    def _preempt(self, victim: Request, batch: _Batch, reason: PreemptionReason) -> None:
        self.running.remove(victim)
        batch.remove(victim)
        batch.preempted.append(victim)
        victim.preempted_at.append(self.iteration)
        victim.num_preemptions += 1
        if reason == "priority":
            # It queues again as if it arrived now: kept at the head by its old arrival, it
            # would take the next seat from the next urgent arrival (the one admission just
            # promised a short wait), and under overload every victim did (docs/engine.md).
            victim.num_priority_preemptions += 1
            victim.queue_order_time = self.clock()
        # The runner copies swap-outs before swap-ins: a swap-out after this batch's swap-ins
        # (priority preemption at admission) could overwrite host blocks they just released.
        can_swap = (
            not batch.swap_in
            and len(self.swapped) < policy.MAX_CONCURRENT_SWAPS
            and self.kv.can_swap_out(victim)
        )
        mode = policy.choose_preemption_mode(victim, self.config, self.preemption_costs, can_swap)
        self.num_preemptions_by_cause[mode, reason] += 1
        if mode == "swap":
            batch.swap_out += self.kv.swap_out(victim)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
        else:
            self.kv.free(victim)
            victim.status = RequestStatus.PREEMPTED
            victim.num_computed_tokens = 0
            self.waiting.append(victim)
            self.fair_share.requeued(victim.tenant)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_preemptions(self) -> int:
        return sum(self.num_preemptions_by_cause.values())

    @property
    def num_preemptions_by_mode(self) -> dict[str, int]:
        """Preemptions so far by mode, whatever their reason."""
        counts = dict.fromkeys(PREEMPTION_MODES, 0)
        for (mode, _), n in self.num_preemptions_by_cause.items():
            counts[mode] += n
        return counts

    @property
    def num_preemptions_by_reason(self) -> dict[str, int]:
        """Preemptions so far by reason, whatever their mode."""
        counts: dict[str, int] = dict.fromkeys(PREEMPTION_REASONS, 0)
        for (_, reason), n in self.num_preemptions_by_cause.items():
            counts[reason] += n
        return counts

    # ----------------------------------------------------------------- one iteration

    def schedule(self) -> SchedulerOutput:
        """Choose this iteration's batch and reserve its KV slots."""
        self.iteration += 1
        batch = _Batch(self.config.max_num_batched_tokens)
        self._schedule_running(batch)
        if not batch.preempted:
            if self._resume_swapped(batch):
                self._admit_waiting(batch)
            elif self.config.priority_preemption_margin > 0:
                # Swapped requests wait for room; only those more urgent than all of them
                # (by the margin) may go first, taking room from less urgent running ones.
                self._admit_waiting(batch, urgent_only=True)
        out = self._build_output(batch)
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        return out

    def _schedule_running(self, batch: _Batch) -> None:
        # Decodes first so that a long prefill never delays running streams.
        for request in sorted(self.running, key=lambda r: (self._is_prefill(r), r.admit_seq)):
            if batch.budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, request.num_computed_tokens, batch.budget)
            while not self.kv.allocate_slots(request, num_new):
                if len(self.running) == 1:
                    # Alone and still out of blocks: the pool cannot hold this sequence.
                    self._finish_capacity(request)
                    break
                victim = policy.select_victim(
                    self.running, self.clock(), self.iteration, self.config
                )
                self._preempt(victim, batch, "kv")
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                self._add_to_batch(batch, request, num_new)

    def _resume_swapped(self, batch: _Batch) -> bool:
        """Swap requests back in, oldest first; True when none is left waiting for room."""
        while self.swapped and batch.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, batch.budget)
            copies = self.kv.swap_in(request, num_new)
            if copies is None:
                if not self.running:
                    # Every device block is free and it still does not fit: it never will.
                    self.swapped.pop(0)
                    self._finish_capacity(request, queued=True)
                    continue
                return False
            self.swapped.pop(0)
            batch.swap_in += copies
            batch.resumed.append(request)
            self._start_running(request)
            self._add_to_batch(batch, request, num_new)
        return not self.swapped

    def _admit_waiting(self, batch: _Batch, urgent_only: bool = False) -> None:
        """Admit waiting requests in queue order (``policy.AdmissionOrder``) while budget,
        seats and blocks allow; with ``urgent_only``, only those more urgent than every
        swapped request by the margin."""
        if self.config.batching == "static" and not self._static_admission_open():
            return
        seats_full = len(self.running) >= self.config.max_num_seqs
        if not self.waiting or (seats_full and self.config.priority_preemption_margin <= 0):
            return  # nothing could be admitted: skip ordering the queue
        now = self.clock()
        order = policy.AdmissionOrder(self.waiting, now, self.config, self.fair_share)
        admitted: set[int] = set()
        while batch.budget > 0 and (request := order.peek()) is not None:
            if urgent_only and not self._more_urgent_than_swapped(request, now):
                break
            if request.wait_for is not None and not self._sibling_ready(request.wait_for):
                order.skip()  # completion i > 0 of n: wait for the shared prompt blocks
                continue
            if any(request is r for r in batch.preempted):
                order.skip()  # preempted for a more urgent one in this iteration: not back yet
                continue
            hits = self.kv.get_computed_blocks(request)
            num_computed = len(hits) * self.kv.block_size
            remaining = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and remaining > batch.budget:
                break
            num_new = self._num_new_tokens(request, num_computed, batch.budget)
            if len(self.running) >= self.config.max_num_seqs:
                # One seat short only: over the cap (max_num_seqs lowered live) the excess
                # drains as it finishes rather than all at once for one arrival.
                at_cap = len(self.running) == self.config.max_num_seqs
                if at_cap and self._preempt_for(request, batch, now, hits, num_new):
                    continue  # a seat is free now (and the blocks will be): try again
                break
            nothing_running = not self.running
            if not self.kv.allocate_slots(
                request, num_new, hits, use_watermark=not nothing_running
            ):
                if nothing_running:
                    # Every block is free and it still does not fit: it never will.
                    order.take()
                    admitted.add(id(request))
                    self.fair_share.left_waiting(request.tenant)
                    self._finish_capacity(request, queued=True)
                    continue
                if self._preempt_for(request, batch, now, hits, num_new):
                    continue  # blocks were freed: look the prefix up again and retry
                break
            admitted.add(id(request))
            self.fair_share.left_waiting(request.tenant)
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
            if self.kv.enable_caching:
                self.num_prefix_cache_queries += request.num_tokens
                self.num_prefix_cache_hits += num_computed
            self._start_running(request)
            batch.admitted.append(request)
            self._add_to_batch(batch, request, num_new)
            order.take()  # after the charge: its tenant's next turn reads the new counter
        if admitted:
            self.waiting = [r for r in self.waiting if id(r) not in admitted]

    def _preempt_for(
        self, request: Request, batch: _Batch, now: float, hits: list[KVBlock], num_new: int
    ) -> bool:
        """Preempt the first of ``request``'s priority victims (never one swapped in or admitted
        by this batch) so that ``request`` (its prefix-cache ``hits`` and ``num_new`` tokens to
        schedule) can be admitted; False (nothing preempted) when it has none, or when its
        blocks would not be free even after all of them gave theirs back. Exact: blocks another
        request still holds, and ``request``'s own hits, are not counted as freed."""
        exempt = {id(r) for r in batch.resumed} | {id(r) for r in batch.admitted}
        candidates = [r for r in self.running if id(r) not in exempt]
        victims = policy.priority_victims(request, candidates, now, self.iteration, self.config)
        if not victims:
            return False
        needed = self.kv.num_free_blocks_needed(request, num_new, hits)
        reserve = self.kv.num_watermark_blocks if self.running else 0
        shortfall = needed + reserve - self.kv.pool.num_free_blocks
        if shortfall > 0:
            freed = self.kv.num_blocks_freed_by([v.request_id for v in victims], keep=hits)
            if freed < shortfall:
                return False
        self._preempt(victims[0], batch, "priority")
        return True

    def _add_to_batch(self, batch: _Batch, request: Request, num_new: int) -> None:
        """Schedule ``num_new`` tokens of ``request``; charge its tenant for the prompt tokens
        computed for the first time (fair share)."""
        batch.add(request, num_new)
        end = min(request.num_computed_tokens + num_new, request.num_prompt_tokens)
        start = max(request.num_computed_tokens, request.num_charged_prompt_tokens)
        if end > start:
            self.fair_share.charge(request.tenant, num_prefill_tokens=end - start)
            request.num_charged_prompt_tokens = end

    def _more_urgent_than_swapped(self, request: Request, now: float) -> bool:
        """Whether ``request`` may be admitted ahead of every swapped request: more urgent
        than each by at least the priority preemption margin."""
        margin = self.config.priority_preemption_margin
        mine = policy.effective_priority(request, now, self.config)
        return all(
            policy.effective_priority(r, now, self.config) - mine >= margin for r in self.swapped
        )

    def _static_admission_open(self) -> bool:
        """Static batching: admit only into an empty engine, and keep admitting (over several
        iterations if the budget is short) until the batch is full or a member has sampled
        (``update_from_output`` closes it)."""
        if not self.running:
            self._static_batch_open = True
        return self._static_batch_open

    @staticmethod
    def _sibling_ready(sibling: Request) -> bool:
        return sibling.prompt_computed or sibling.is_finished

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.admit_seq = next(self._admit_counter)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        self.running.append(request)

    def _finish_capacity(self, request: Request, queued: bool = False) -> None:
        if not queued:
            self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
        self._capacity_finished.append(request)

    @staticmethod
    def _is_prefill(request: Request) -> bool:
        return request.num_tokens - request.num_computed_tokens > 1

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0 and num_new > 1:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def _build_output(self, batch: _Batch) -> SchedulerOutput:
        scheduled = []
        for request_id, num_new in batch.num_tokens.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            scheduled.append(
                ScheduledRequest(
                    request_id=request_id,
                    token_ids=request.all_token_ids[start : start + num_new],
                    num_computed_tokens=start,
                    block_table=self.kv.block_ids(request_id),
                    sample=start + num_new == request.num_tokens,
                    sampling_params=request.sampling_params,
                    prompt_token_ids=request.prompt_token_ids,
                )
            )
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        return SchedulerOutput(
            scheduled=scheduled,
            preempted_request_ids=[r.request_id for r in batch.preempted],
            finished_request_ids=finished,
            blocks_to_swap_out=batch.swap_out,
            blocks_to_swap_in=batch.swap_in,
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
            self.fair_share.charge(request.tenant, num_output_tokens=1)
            self._static_batch_open = False  # a member decodes: the static batch is formed
            stopped = self.stop_checker is not None and self.stop_checker(request)
            status = RequestStatus.FINISHED_STOPPED if stopped else None
            status = status or request.check_stop(self.max_model_len)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updated.append(request)
        return updated

    def check_integrity(self) -> None:
        """Assert the queue and block invariants (tests call this after every step)."""
        self.kv.check_integrity()
        queues = [self.running, self.waiting, self.swapped]
        ids = [r.request_id for q in queues for r in q]
        assert len(ids) == len(set(ids)) == len(self.requests), "a request is lost or queued twice"
        assert set(ids) == set(self.requests)
        self.fair_share.check_counts(
            [r.tenant for r in self.waiting], [r.tenant for r in self.requests.values()]
        )
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            num_blocks = len(self.kv.block_ids(request.request_id))
            assert num_blocks >= self.kv.num_blocks_for(request.num_computed_tokens), request
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not self.kv.block_ids(request.request_id), request
            assert request.num_computed_tokens == 0, request
        for request in self.swapped:
            assert request.status == RequestStatus.SWAPPED
            assert not self.kv.block_ids(request.request_id), request
            host = self.kv.host_block_ids(request.request_id)
            assert len(host) == self.kv.num_blocks_for(request.num_computed_tokens), request
