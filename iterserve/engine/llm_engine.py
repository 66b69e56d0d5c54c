"""``LLMEngine``: add requests, abort them, and step the iteration loop (no torch here).

Each step yields :class:`~iterserve.engine.messages.RequestDelta` s, only what is new per
request (:meth:`LLMEngine.step_deltas`, what the engine loop sends its clients); offline use
(:meth:`LLMEngine.step`, ``LLM.generate``) folds them into cumulative ``RequestOutput`` s.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from typing import Any

from iterserve.config import EngineConfig
from iterserve.engine.detokenizer import IncrementalDetokenizer
from iterserve.engine.kv_cache_manager import KVCacheManager
from iterserve.engine.limits import RequestLimits
from iterserve.engine.messages import (
    AddRequest,
    Clock,
    EngineLoad,
    IterationStats,
    RequestDelta,
    monotonic_clock,
)
from iterserve.engine.outputs import (
    ModelRunner,
    ModelRunnerOutput,
    OutputAccumulator,
    RequestOutput,
    TokenLogprobs,
)
from iterserve.engine.parent_request import Completion, ParentRequest
from iterserve.engine.policy import PreemptionCosts
from iterserve.engine.request import DEFAULT_TENANT, Request
from iterserve.engine.request import RequestStatus as Status
from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.scheduler import Scheduler
from iterserve.engine.tokenizer import Tokenizer
from iterserve.kv_events import KVCacheEvent

TELEMETRY_LEN = 1024


class IterationError(RuntimeError):
    """An iteration's forward raised; the requests it carried were aborted.

    Attributes:
        request_ids: the aborted (user-level) request ids.
    """

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(
            f"iteration failed ({type(cause).__name__}: {cause}); aborted {request_ids}"
        )
        self.request_ids = request_ids
        self.cause = cause

    def __reduce__(self) -> tuple[type, tuple[list[str], BaseException]]:
        # Picklable across processes (the cause travels as a plain RuntimeError).
        return (type(self), (self.request_ids, RuntimeError(str(self.cause))))


class LLMEngine:
    """The synchronous engine core: one :meth:`step` is one scheduler decision + one forward.
    Built by :func:`~iterserve.engine.factory.build_engine`.

    Args:
        config: engine settings with ``model.max_model_len`` resolved.
        runner: executes a ``SchedulerOutput`` (the model runner, or a fake in tests).
        tokenizer: for output text and stop strings (None: no text).
        num_kv_blocks: size of the KV pool in blocks (found at start-up).
        vocab_size: number of token ids the model accepts.
        eos_token_ids: token ids that end a request unless ``ignore_eos``.
        num_host_blocks: blocks in the host swap pool (from ``swap_space``).
        preemption_costs: measured at start-up, for ``preemption_mode=auto``.
        model_dir: where the model (and its tokenizer) was loaded from, for clients.
        clock: seconds (arrival and admission times, aging, iteration latency); the simulator
            passes a virtual clock.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer | None,
        num_kv_blocks: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        num_host_blocks: int = 0,
        preemption_costs: PreemptionCosts | None = None,
        model_dir: str | None = None,
        clock: Clock = monotonic_clock,
    ) -> None:
        max_model_len = config.model.max_model_len
        if max_model_len is None:
            raise ValueError(
                "config.model.max_model_len must be resolved before building the engine"
            )
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.clock = clock
        kv = KVCacheManager(
            num_kv_blocks,
            config.cache.block_size,
            enable_caching=config.cache.enable_prefix_caching,
            watermark=config.scheduler.kv_watermark,
            num_host_blocks=num_host_blocks,
        )
        self.scheduler = Scheduler(
            config.scheduler,
            kv,
            max_model_len,
            self._check_stop_strings,
            preemption_costs,
            clock=clock,
        )
        self._parents: dict[str, ParentRequest] = {}
        self._completions: dict[str, tuple[ParentRequest, Completion]] = {}  # child id ->
        # Offline use (step / abort_request): cumulative outputs built from the deltas.
        self._accumulators: dict[str, OutputAccumulator] = {}
        self.telemetry: deque[IterationStats] = deque(maxlen=TELEMETRY_LEN)
        self.num_iterations = 0
        self.model_dir = model_dir
        # Cumulative counters as of the last telemetry record (records hold differences).
        self._last_counts = (0, 0, 0, 0, 0)

    # ----------------------------------------------------------------- requests

    @property
    def limits(self) -> RequestLimits:
        """What a request is checked against (picklable: a client process validates)."""
        kv = self.scheduler.kv
        return RequestLimits(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            num_kv_blocks=kv.num_blocks,
            block_size=kv.block_size,
            has_tokenizer=self.tokenizer is not None,
            scheduler=self.scheduler.config,
        )

    def resolve_priority(self, priority: int | str | None) -> int:
        """See :meth:`RequestLimits.resolve_priority`."""
        return self.limits.resolve_priority(priority)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """See :meth:`RequestLimits.validate`."""
        self.limits.validate(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int | str | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        """Validate and queue a request (``params.n`` completions of the prompt); offline use,
        where this is the edge: :meth:`step` returns its cumulative outputs.

        Raises:
            InvalidRequestError: the request can never be served; nothing was queued.
            ValueError: ``request_id`` is already in use.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {request_id!r}")
        self.validate(prompt_token_ids, params)
        arrival = self.clock() if arrival_time is None else arrival_time
        message = AddRequest(
            request_id,
            list(prompt_token_ids),
            params,
            self.resolve_priority(priority),
            arrival,
            prompt,
            tenant,
        )
        self.add(message)
        self._accumulators[request_id] = OutputAccumulator(
            request_id,
            prompt,
            message.prompt_token_ids,
            params.n,
            params.logprobs is not None,
            arrival,
        )

    def add(self, message: AddRequest) -> None:
        """Queue a request its client has validated (the engine loop's path).

        Raises:
            ValueError: the request id (or a child id) is already in use.
        """
        request_id, params = message.request_id, message.params
        child_ids = (
            [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        )
        taken = [
            i for i in [request_id, *child_ids] if i in self._parents or i in self._completions
        ]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        completions: list[Completion] = []
        for index, child_id in enumerate(child_ids):
            child_params = params.child(index) if params.n > 1 else params
            request = Request(
                child_id,
                message.prompt_token_ids,
                child_params,
                self.eos_token_ids,
                message.arrival_time,
                message.priority,
                message.tenant,
            )
            if index > 0:
                request.wait_for = completions[0].request
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, message.prompt_token_ids, child_params
                )
            logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
            completions.append(Completion(request, index, detok, logprobs))
        parent = ParentRequest(request_id, message.prompt, completions)
        for c in completions:
            self.scheduler.add_request(c.request)
            self._completions[c.request.request_id] = (parent, c)
        self._parents[request_id] = parent

    def abort(self, request_ids: str | list[str]) -> list[RequestDelta]:
        """Abort requests now, freeing their KV blocks; their final deltas (unknown or
        finished ids are ignored)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        deltas = []
        for request_id in ids:
            parent = self._parents.get(request_id)
            if parent is None:
                continue
            child_ids = [c.request.request_id for c in parent.completions]
            self.scheduler.finish_requests(child_ids, Status.FINISHED_ABORTED)
            deltas.append(self._make_delta(parent, parent.completions))
        return deltas

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests now, freeing their KV blocks; returns their final outputs."""
        return self._accumulate(self.abort(request_ids))

    def abort_all(self) -> list[RequestDelta]:
        """Abort every request (shutdown); their final deltas."""
        return self.abort(list(self._parents))

    def load(self) -> EngineLoad:
        """Queue and pool counts now (what ``/load`` reports; ``num_*`` count sequences)."""
        sched = self.scheduler
        return EngineLoad(
            kv_cache_usage=sched.kv.pool.usage,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            num_free_blocks=sched.kv.pool.num_free_blocks,
            num_cached_blocks=sched.kv.pool.num_cached_blocks,
            num_total_blocks=sched.kv.num_blocks,
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def update_scheduler_config(self, config: Any) -> None:
        """Apply new scheduler settings from the next iteration on (call between steps)."""
        self.scheduler.update_config(config)

    def enable_kv_events(self) -> None:
        """Record KV-cache events (:mod:`iterserve.kv_events`) from now on."""
        self.scheduler.kv.pool.enable_kv_events()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call, oldest first (empty unless enabled)."""
        return self.scheduler.kv.pool.take_events()

    def telemetry_since(self, num_iterations: int) -> list[IterationStats]:
        """Records of the iterations after the first ``num_iterations`` (those still kept)."""
        num_new = min(self.num_iterations - num_iterations, len(self.telemetry))
        return list(itertools.islice(reversed(self.telemetry), num_new))[::-1]

    # ----------------------------------------------------------------- iteration

    def step(self) -> list[RequestOutput]:
        """Run one iteration; the cumulative outputs of requests added by
        :meth:`add_request` that advanced or finished (offline use)."""
        return self._accumulate(self.step_deltas())

    def step_deltas(self) -> list[RequestDelta]:
        """Run one iteration; what is new for each request that advanced or finished."""
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        runner_output = ModelRunnerOutput(sampled_token_ids={})
        if scheduler_output.has_runner_work:
            try:
                runner_output = self.runner.execute_model(scheduler_output)
            except Exception as e:
                # The KV of every request in this iteration (and of any request swapped out
                # in it) may be half-written: end those requests, keep the others.
                ids = [s.request_id for s in scheduler_output.scheduled]
                ids += scheduler_output.preempted_request_ids
                failed = sorted(
                    {self._completions[i][0].request_id for i in ids if i in self._completions}
                )
                self.abort(failed)
                for request_id in failed:
                    self._accumulators.pop(request_id, None)
                raise IterationError(failed, e) from e
        for request_id, logprobs in runner_output.logprobs.items():
            entry = self._completions.get(request_id)
            if entry is not None and entry[1].pending_logprobs is not None:
                entry[1].pending_logprobs.append(logprobs)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        if not scheduler_output.is_empty:
            self.num_iterations += 1
            self._record(
                scheduler_output,
                self.clock() - start,
                len(runner_output.sampled_token_ids),
            )
        touched: dict[str, tuple[ParentRequest, list[Completion]]] = {}
        for request in updated:
            parent, completion = self._completions[request.request_id]
            touched.setdefault(parent.request_id, (parent, []))[1].append(completion)
        deltas = [self._make_delta(parent, changed) for parent, changed in touched.values()]
        return [d for d in deltas if d.completions or d.finished]

    def _check_stop_strings(self, request: Request) -> bool:
        completion = self._completions[request.request_id][1]
        if completion.detokenizer is None:
            return False
        can_stop = request.num_output_tokens >= request.sampling_params.min_tokens
        stop = completion.detokenizer.append(request.all_token_ids[-1], can_stop)
        if stop is None:
            return False
        request.stop_reason = stop
        return True

    def _record(self, out: Any, latency: float, num_generated: int) -> None:
        prefill = sum(
            s.num_scheduled_tokens
            for s in out.scheduled
            if not s.sample or s.num_scheduled_tokens > 1
        )
        sched = self.scheduler
        by_cause = sched.num_preemptions_by_cause
        counts = (
            by_cause["swap", "kv"] + by_cause["swap", "priority"],
            by_cause["recompute", "priority"] + by_cause["swap", "priority"],
            by_cause["swap", "priority"],
            sched.num_prefix_cache_queries,
            sched.num_prefix_cache_hits,
        )
        swaps, priority, priority_swaps, queries, hits = (
            now - last for now, last in zip(counts, self._last_counts, strict=True)
        )
        self._last_counts = counts
        self.telemetry.append(
            IterationStats(
                time=self.clock(),
                latency_s=latency,
                num_prefill_tokens=prefill,
                num_decode_tokens=out.num_scheduled_tokens - prefill,
                num_running=len(sched.running),
                num_waiting=len(sched.waiting),
                num_swapped=len(sched.swapped),
                num_free_blocks=sched.kv.pool.num_free_blocks,
                num_preemptions=len(out.preempted_request_ids),
                num_swap_preemptions=swaps,
                num_generated_tokens=num_generated,
                num_prefix_cache_queries=queries,
                num_prefix_cache_hits=hits,
                num_priority_preemptions=priority,
                num_priority_swap_preemptions=priority_swaps,
                num_scheduled_seqs=len(out.scheduled),
            )
        )

    def _make_delta(self, parent: ParentRequest, changed: list[Completion]) -> RequestDelta:
        """The delta of ``changed`` completions; forgets a finished parent."""
        delta = parent.take_delta(changed)
        if parent.finished:
            self._parents.pop(parent.request_id, None)
            for c in parent.completions:
                self._completions.pop(c.request.request_id, None)
            requests = [c.request for c in parent.completions]
            block_size = self.config.cache.block_size
            delta = dataclasses.replace(
                delta,
                num_preemptions=sum(r.num_preemptions for r in requests),
                num_computed_tokens=sum(r.num_computed_tokens for r in requests),
                num_kv_blocks=sum(-(-r.num_computed_tokens // block_size) for r in requests),
            )
        return delta

    def _accumulate(self, deltas: list[RequestDelta]) -> list[RequestOutput]:
        """Cumulative snapshots of the offline requests among ``deltas``."""
        outputs = []
        for delta in deltas:
            accumulator = self._accumulators.get(delta.request_id)
            if accumulator is None:
                continue
            accumulator.add(delta)
            outputs.append(accumulator.snapshot())
            if delta.finished:
                del self._accumulators[delta.request_id]
        return outputs
