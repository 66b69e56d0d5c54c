"""The simulated model runner: tokens without a model, each iteration as long as the latency
profile predicts.

It implements the engine's ``ModelRunner`` protocol, so the real scheduler, block manager and
engine run over it unchanged. Per iteration it computes the batch's
:class:`~iterserve.sim.profile.BatchShape`, waits out the predicted time (``wait``: a sleep in
a live replica, a virtual-clock advance in a replay) and samples, for every request at the
end of its sequence, a deterministic token:

- a request's output is fixed by its prompt, its completion index and the runner's seed
  (so a replay is reproducible and ``n`` completions differ);
- its EOS position is drawn once from the profile's output-length distribution; EOS is
  emitted there (not before ``min_tokens``, never with ``ignore_eos``), and ``max_tokens``
  ends it as usual;
- other tokens are drawn from the tokenizer's ordinary ids (plain words);
- logprobs, when asked for, are made up: the sampled token at -0.1, alternatives below.
"""

from __future__ import annotations

import math
import random
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from iterserve.engine.outputs import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from iterserve.engine.policy import PreemptionCosts
from iterserve.sim.profile import BatchShape, LatencyProfile, OutputLengths

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_output_len(dist: OutputLengths, rng: random.Random) -> int:
    """One output length (tokens) from ``dist``, within ``[min, max]``."""
    if dist.distribution == "constant":
        value = dist.median
    elif dist.distribution == "uniform":
        return rng.randint(dist.min, max(dist.min, dist.max))
    else:  # drawn in log space and clipped there: a wide sigma cannot overflow
        log_value = math.log(dist.median) + dist.sigma * rng.gauss(0.0, 1.0)
        value = math.exp(min(log_value, math.log(dist.max) + 1.0))
    return int(min(dist.max, max(dist.min, round(value))))


@dataclass
class _RequestState:
    seed: int
    num_prompt_tokens: int
    eos_at: int  # the output length at which EOS is sampled


class SimulatedModelRunner:
    """A ``ModelRunner`` that waits instead of computing.

    Args:
        profile: predicts each iteration's latency.
        wait: called with the predicted seconds of each iteration (profile time).
        ordinary_token_ids: ids to emit as text (non-empty).
        eos_token_id: the id emitted at a request's drawn output length.
        seed: makes outputs and output lengths reproducible.
        include_engine_overhead: also wait the profile's engine overhead and serving CPU (a
            replay, whose own scheduler and front cost no virtual time); a live replica's
            real scheduler and HTTP front spend them.
        output_lengths: overrides the profile's distribution.
    """

    def __init__(
        self,
        profile: LatencyProfile,
        wait: Callable[[float], None],
        ordinary_token_ids: list[int],
        eos_token_id: int,
        seed: int = 0,
        include_engine_overhead: bool = False,
        output_lengths: OutputLengths | None = None,
    ) -> None:
        if not ordinary_token_ids:
            raise ValueError("the simulated runner needs at least one ordinary token id")
        self.profile = profile
        self.wait = wait
        self.token_ids = ordinary_token_ids
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.include_engine_overhead = include_engine_overhead
        self.output_lengths = output_lengths or profile.output_lengths
        self.states: dict[str, _RequestState] = {}
        self.num_iterations = 0
        self.busy_s = 0.0  # profile seconds waited in total

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self.states.pop(request_id, None)
        shape = BatchShape.of(scheduler_output)
        seconds = 0.0
        if scheduler_output.scheduled or shape.num_swapped_blocks:
            seconds = self.profile.forward_seconds(shape)
            if self.include_engine_overhead:
                seconds += self.profile.overhead_seconds(shape)
                seconds += self.profile.serving_seconds(shape)
            self.num_iterations += 1
        if seconds > 0:
            self.busy_s += seconds
            self.wait(seconds)
        sampled = {s.request_id: self._sample(s) for s in scheduler_output.scheduled if s.sample}
        logprobs = {
            s.request_id: self._logprobs(sampled[s.request_id], s.sampling_params.logprobs)
            for s in scheduler_output.scheduled
            if s.sample and s.sampling_params.logprobs is not None
        }
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def measure_preemption_costs(self) -> PreemptionCosts:
        """The profile's prefill time per token and swap bandwidth (nothing is timed)."""
        return PreemptionCosts(
            self.profile.prefill_seconds_per_token(),
            self.profile.swap.bytes_per_s,
            self.profile.kv_cache.kv_bytes_per_token,
        )

    def _logprobs(self, token_id: int, num_top: int) -> TokenLogprobs:
        """Made-up but well-formed logprobs: the sampled token is the likeliest (-0.1), the
        alternatives are ordinary tokens at -2, -3, ..."""
        top = [(token_id, -0.1)]
        for k in range(1, num_top):
            other = self.token_ids[_mix(token_id * 31 + k) % len(self.token_ids)]
            if all(other != t for t, _ in top):
                top.append((other, -1.0 - k))
        return TokenLogprobs(token_id, -0.1, top[:num_top])

    def _state(self, s: ScheduledRequest) -> _RequestState:
        state = self.states.get(s.request_id)
        if state is None:
            prompt = array("q", s.prompt_token_ids).tobytes()
            # Completions of one request ("id#k") differ; equal prompts otherwise agree.
            _, _, index = s.request_id.rpartition("#")
            child = int(index) if index.isdigit() else 0
            seed = _mix(_mix(self.seed) ^ zlib.crc32(prompt) ^ (child << 40))
            eos_at = draw_output_len(self.output_lengths, random.Random(seed))
            state = _RequestState(seed, len(s.prompt_token_ids), eos_at)
            self.states[s.request_id] = state
        return state

    def _sample(self, s: ScheduledRequest) -> int:
        state = self._state(s)
        num_output = s.seq_len - state.num_prompt_tokens + 1  # counting this token
        params = s.sampling_params
        if not params.ignore_eos and num_output == max(state.eos_at, params.min_tokens):
            return self.eos_token_id
        return self.token_ids[_mix(state.seed ^ num_output) % len(self.token_ids)]
