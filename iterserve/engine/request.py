"""A request's state inside the engine: tokens, progress counter and status."""

from __future__ import annotations

import enum

from iterserve.engine.sampling_params import SamplingParams

# The tenant of a request that names none (docs/server.md, "Tenants").
DEFAULT_TENANT = "default"


class RequestStatus(enum.IntEnum):
    """Ordered so that every status after ``SWAPPED`` is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # recompute: back in the waiting queue without blocks
    SWAPPED = 3  # swap: its KV blocks sit in the host pool
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.SWAPPED


# The one map from finished statuses to OpenAI's ``finish_reason``.
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being served.

    Progress is one counter: ``num_computed_tokens`` of ``all_token_ids`` (prompt + output)
    have their KV in the cache. Each iteration computes some of the rest; when it reaches
    the end, the runner samples the next token. Chunked prefill, prefix-cache hits and
    recompute after preemption are all just different values of that counter::

        all_token_ids: [p0 p1 ... p(P-1) | o0 o1 ... o(O-1)]
                        <--- computed ---><-- to compute -->
                                          ^ num_computed_tokens
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float = 0.0,
        priority: int = 1,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time  # seconds of the engine's clock
        # What the queue order and aging count from: the arrival, or the latest preemption
        # for a more urgent request (it then queues as if it arrived at that moment).
        self.queue_order_time = arrival_time
        self.priority = priority  # lower is more urgent
        self.tenant = tenant  # who sent it (fair share between tenants)
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when first admitted (usage reporting).
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        # Of num_preemptions, those for a more urgent waiting request (policy.victim_priority).
        self.num_priority_preemptions = 0
        # Prompt tokens whose computation has been charged to the tenant (fair share): the
        # high-water mark, so a recompute after preemption is not charged twice.
        self.num_charged_prompt_tokens = 0
        # When it was first admitted (monotonic seconds; queue time = this - arrival_time).
        self.first_scheduled_time: float | None = None
        # Admission order among running requests (set each time it is admitted).
        self.admit_seq = -1
        # Insertion order into the scheduler (ties between equal arrival times).
        self.arrival_seq = 0
        # Iterations at which it was preempted (anti-thrashing protection).
        self.preempted_at: list[int] = []
        # Chain hashes of this request's full blocks, extended as tokens are appended.
        self.block_hashes: list[bytes] = []
        # Completion i > 0 of an n > 1 request waits until completion 0 has computed the
        # prompt, so that it starts from the shared (prefix-cached) prompt blocks.
        self.wait_for: Request | None = None
        self.stop_reason: str | int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    @property
    def prompt_computed(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last appended token causes, or None to go on."""
        params = self.sampling_params
        last = self.all_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
