"""``LLMEngine``: add requests, abort them, and step the iteration loop (no torch here)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from iterserve.config import EngineConfig
from iterserve.engine.detokenizer import IncrementalDetokenizer
from iterserve.engine.kv_cache_manager import KVCacheManager
from iterserve.engine.limits import RequestLimits
from iterserve.engine.outputs import (
    CompletionOutput,
    ModelRunner,
    ModelRunnerOutput,
    RequestOutput,
    TokenLogprobs,
)
from iterserve.engine.policy import PreemptionCosts
from iterserve.engine.request import FINISH_REASONS, Request
from iterserve.engine.request import RequestStatus as Status
from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.scheduler import Scheduler

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


@dataclass(frozen=True)
class IterationStats:
    """One iteration, as recorded for metrics."""

    time: float  # monotonic seconds at its end
    latency_s: float  # schedule + forward + update
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_preemptions: int
    num_swap_preemptions: int = 0  # of num_preemptions, those that swapped
    num_generated_tokens: int = 0  # tokens sampled
    num_prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    num_prefix_cache_hits: int = 0  # of those, tokens found cached


@dataclass
class _Completion:
    """Engine-side bookkeeping of one completion (child request) of a user request."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None


class _Parent:
    """A user request: ``n`` completions of one prompt."""

    def __init__(self, request_id: str, prompt: str | None, completions: list[_Completion]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.completions = completions

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.completions)


class LLMEngine:
    """The synchronous engine core: one :meth:`step` is one scheduler decision + one forward.

    Args:
        config: engine settings with ``model.max_model_len`` resolved.
        runner: executes a ``SchedulerOutput`` (the model runner, or a fake in tests).
        tokenizer: a Hugging Face tokenizer for output text and stop strings (None: no text).
        num_kv_blocks: size of the KV pool in blocks (found at start-up).
        vocab_size: number of token ids the model accepts.
        eos_token_ids: token ids that end a request unless ``ignore_eos``.
        num_host_blocks: blocks in the host swap pool (from ``swap_space``).
        preemption_costs: measured at start-up, for ``preemption_mode=auto``.
        model_dir: where the model (and its tokenizer) was loaded from, for clients.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Any,
        num_kv_blocks: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        num_host_blocks: int = 0,
        preemption_costs: PreemptionCosts | None = None,
        model_dir: str | None = None,
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
        kv = KVCacheManager(
            num_kv_blocks,
            config.cache.block_size,
            enable_caching=config.cache.enable_prefix_caching,
            watermark=config.scheduler.kv_watermark,
            num_host_blocks=num_host_blocks,
        )
        self.scheduler = Scheduler(
            config.scheduler, kv, max_model_len, self._check_stop_strings, preemption_costs
        )
        self._parents: dict[str, _Parent] = {}
        self._completions: dict[str, tuple[_Parent, _Completion]] = {}  # child id ->
        self.telemetry: deque[IterationStats] = deque(maxlen=TELEMETRY_LEN)
        self.num_iterations = 0
        self.model_dir = model_dir
        # Cumulative counters as of the last telemetry record (records hold differences).
        self._last_counts = (0, 0, 0)

    # ----------------------------------------------------------------- requests

    @property
    def limits(self) -> RequestLimits:
        """What a request is checked against (picklable: a client process validates too)."""
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
    ) -> None:
        """Validate and queue a request (``params.n`` completions of the prompt).

        Raises:
            InvalidRequestError: the request can never be served; nothing was queued.
            ValueError: ``request_id`` is already in use.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {request_id!r}")
        self.validate(prompt_token_ids, params)
        prio = self.resolve_priority(priority)
        child_ids = (
            [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        )
        taken = [
            i for i in [request_id, *child_ids] if i in self._parents or i in self._completions
        ]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        completions: list[_Completion] = []
        for index, child_id in enumerate(child_ids):
            child_params = params.child(index) if params.n > 1 else params
            request = Request(
                child_id, prompt_token_ids, child_params, self.eos_token_ids, arrival, prio
            )
            if index > 0:
                request.wait_for = completions[0].request
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child_params)
            logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
            completions.append(_Completion(request, index, detok, logprobs))
        parent = _Parent(request_id, prompt, completions)
        for c in completions:
            self.scheduler.add_request(c.request)
            self._completions[c.request.request_id] = (parent, c)
        self._parents[request_id] = parent

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests now, freeing their KV blocks; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            parent = self._parents.get(request_id)
            if parent is None:
                continue
            child_ids = [c.request.request_id for c in parent.completions]
            self.scheduler.finish_requests(child_ids, Status.FINISHED_ABORTED)
            outputs.append(self._make_output(parent))
        return outputs

    def stats(self) -> dict[str, Any]:
        """Queue and pool counts now (what ``/load`` reports; ``num_*`` count requests)."""
        sched = self.scheduler
        return {
            "kv_cache_usage": sched.kv.pool.usage,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_swapped": len(sched.swapped),
            "num_free_blocks": sched.kv.pool.num_free_blocks,
            "num_cached_blocks": sched.kv.pool.num_cached_blocks,
            "num_total_blocks": sched.kv.num_blocks,
        }

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request (shutdown)."""
        return self.abort_request(list(self._parents))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def update_scheduler_config(self, config: Any) -> None:
        """Apply new scheduler settings from the next iteration on (call between steps)."""
        self.scheduler.update_config(config)

    # ----------------------------------------------------------------- iteration

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of requests that advanced or finished."""
        start = time.perf_counter()
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
                self.abort_request(failed)
                raise IterationError(failed, e) from e
        for request_id, logprobs in runner_output.logprobs.items():
            entry = self._completions.get(request_id)
            if entry is not None and entry[1].logprobs is not None:
                entry[1].logprobs.append(logprobs)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        if not scheduler_output.is_empty:
            self.num_iterations += 1
            self._record(
                scheduler_output,
                time.perf_counter() - start,
                len(runner_output.sampled_token_ids),
            )
        touched: dict[str, _Parent] = {}
        for request in updated:
            parent = self._completions[request.request_id][0]
            touched[parent.request_id] = parent
        return [self._make_output(p) for p in touched.values()]

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
        counts = (
            sched.num_preemptions_by_mode["swap"],
            sched.num_prefix_cache_queries,
            sched.num_prefix_cache_hits,
        )
        swaps, queries, hits = (
            now - last for now, last in zip(counts, self._last_counts, strict=True)
        )
        self._last_counts = counts
        self.telemetry.append(
            IterationStats(
                time=time.monotonic(),
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
            )
        )

    def _make_output(self, parent: _Parent) -> RequestOutput:
        finished = parent.finished
        if finished:
            self._parents.pop(parent.request_id, None)
            for c in parent.completions:
                self._completions.pop(c.request.request_id, None)
        outputs = []
        for c in parent.completions:
            request = c.request
            done = request.is_finished
            text = c.detokenizer.visible_text(done) if c.detokenizer is not None else ""
            outputs.append(
                CompletionOutput(
                    index=c.index,
                    text=text,
                    token_ids=request.output_token_ids,
                    finish_reason=FINISH_REASONS.get(request.status),
                    logprobs=c.logprobs,
                    stop_reason=request.stop_reason,
                )
            )
        first = parent.completions[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens or 0,
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
        )
