"""``LLMEngine``: add requests, abort them, and step the iteration loop (no torch here)."""

from __future__ import annotations

import time

from iterserve.config import EngineConfig
from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.kv_cache_manager import KVCacheManager
from iterserve.engine.outputs import (
    CompletionOutput,
    ModelRunner,
    ModelRunnerOutput,
    RequestOutput,
    Tokenizer,
)
from iterserve.engine.request import FINISH_REASONS, Request, RequestStatus
from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.scheduler import Scheduler


class LLMEngine:
    """The synchronous engine core: one :meth:`step` is one scheduler decision + one forward.

    Args:
        config: engine settings with ``model.max_model_len`` resolved.
        runner: executes a :class:`SchedulerOutput` (the model runner, or a fake in tests).
        tokenizer: decodes output tokens to text.
        num_kv_blocks: size of the KV pool in blocks (found at start-up).
        vocab_size: number of token ids the model accepts.
        eos_token_ids: token ids that end a request unless ``ignore_eos``.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer | None,
        num_kv_blocks: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
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
        )
        self.scheduler = Scheduler(config.scheduler, kv, max_model_len)
        self._prompts: dict[str, str | None] = {}
        self.num_iterations = 0
        self.last_iteration_latency = 0.0  # seconds of the last forward

    # ----------------------------------------------------------------- requests

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`InvalidRequestError` for a request that can never be served."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}",
                "prompt",
            )
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {num_prompt} prompt tokens and asks for max_tokens={params.max_tokens}",
                "max_tokens" if num_prompt < self.max_model_len else "prompt",
            )
        kv = self.scheduler.kv
        if kv.num_blocks_for(num_prompt) > kv.num_blocks:
            raise InvalidRequestError(
                f"the prompt ({num_prompt} tokens) needs {kv.num_blocks_for(num_prompt)} KV blocks "
                f"but the whole pool has {kv.num_blocks} blocks of {kv.block_size} tokens",
                "prompt",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request.

        Raises:
            InvalidRequestError: the request can never be served; nothing was queued.
            ValueError: ``request_id`` is already in use.
        """
        self.validate(prompt_token_ids, params)
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time)
        self.scheduler.add_request(request)
        self._prompts[request_id] = prompt

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests now, freeing their KV blocks; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        done = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return [self._make_output(r) for r in done]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    # ----------------------------------------------------------------- iteration

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of requests that advanced or finished."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            runner_output = ModelRunnerOutput(sampled_token_ids={})
            if scheduler_output.finished_request_ids or scheduler_output.preempted_request_ids:
                # Nothing to compute, but the runner must still drop per-request state.
                self.runner.execute_model(scheduler_output)
        else:
            start = time.perf_counter()
            runner_output = self.runner.execute_model(scheduler_output)
            self.last_iteration_latency = time.perf_counter() - start
            self.num_iterations += 1
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        return [self._make_output(r) for r in updated]

    def _make_output(self, request: Request) -> RequestOutput:
        token_ids = request.output_token_ids
        finished = request.is_finished
        if finished:
            prompt = self._prompts.pop(request.request_id, None)
        else:
            prompt = self._prompts.get(request.request_id)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=FINISH_REASONS.get(request.status),
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens or 0,
        )
