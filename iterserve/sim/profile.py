"""Latency profiles: what one engine iteration costs on a given machine, model and dtype.

A profile is a JSON file (schema: :class:`LatencyProfile`) holding a fitted iteration-latency
model, the KV pool, swap and recompute costs, and where the numbers came from. The model is
linear in a few features of the batch, in the manner of Vidur (Agrawal et al., MLSys 2024),
which predicts each operator from the tokens it touches; here the operators are summed into
per-feature coefficients so that one iteration is one dot product::

    forward_s = fixed_s
              + max(linear_floor_s, per_decode_token_s * D + per_prefill_token_s * P)
              + per_context_token_s * C
              + per_attention_pair_s * A
              + per_prefill_seq_s * S_p
              + swapped_blocks * block_size * kv_bytes_per_token / swap.bytes_per_s

    D  decode tokens (requests scheduled for exactly one token)
    P  prefill tokens (chunks of two tokens or more)
    C  context tokens read by the decodes (sum of their sequence lengths)
    A  query-key pairs of the prefill chunks: a chunk of p tokens after o computed ones
       attends to o + 1, o + 2, ..., o + p keys, so it adds p * o + p * (p + 1) / 2
    S_p prefill chunks in the batch (requests scheduled for two tokens or more): what each
       chunk costs whatever its length (its own attention call per layer, its gather of
       prior KV, its logits row); on a CPU, iterations prefilling one fresh short prompt
       beside a few decodes took 1.2-1.4x what the token terms alone predicted
       (docs/simulator.md, "The serving side")

``linear_floor_s`` is the cost the token-proportional part never goes below: on a GPU the
weights are read once per iteration whatever the batch (memory-bound small batches), on a
CPU it is usually 0 and ``fixed_s`` carries the weight reads. The engine's own work around
the forward (scheduling, sampling bookkeeping, detokenization) is a separate term,
:class:`EngineOverhead`, that a live simulated replica does not sleep (its real scheduler
spends that time) and a virtual-time replay adds.

Built-in profiles ship in ``iterserve/sim/profiles/``; :func:`load_profile` takes a name or a
path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from iterserve.engine.outputs import SchedulerOutput
from iterserve.workload.stats import percentile

BUILTIN_PROFILES = ("cpu-smollm2", "a100x4-llama3-70b")
PROFILE_FORMAT_VERSION = 1


class ProfileError(ValueError):
    """A profile that cannot be found or does not validate."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Bounds that keep a profile physical and the simulated pool allocatable.
MAX_SECONDS = 3600.0
MAX_NUM_BLOCKS = 1 << 22


class IterationModel(_Strict):
    """Coefficients of the forward-latency model (seconds; see the module docstring)."""

    fixed_s: float = Field(ge=0, le=MAX_SECONDS)
    linear_floor_s: float = Field(0.0, ge=0, le=MAX_SECONDS)
    per_decode_token_s: float = Field(ge=0, le=MAX_SECONDS)
    per_prefill_token_s: float = Field(ge=0, le=MAX_SECONDS)
    per_context_token_s: float = Field(ge=0, le=MAX_SECONDS)
    per_attention_pair_s: float = Field(ge=0, le=MAX_SECONDS)
    per_prefill_seq_s: float = Field(0.0, ge=0, le=MAX_SECONDS)


class EngineOverhead(_Strict):
    """Engine time around the forward per iteration (seconds): ``fixed_s + per_seq_s * S``,
    ``S`` the requests in the batch."""

    fixed_s: float = Field(0.0, ge=0, le=MAX_SECONDS)
    per_seq_s: float = Field(0.0, ge=0, le=MAX_SECONDS)


class ServingCosts(_Strict):
    """What serving adds beside the engine, measured by ``bench calibrate``'s serve stage
    (:mod:`iterserve.bench.calibrate_serving`) and added by a virtual-time replay (a live
    simulated replica's real HTTP front spends it itself).

    Attributes:
        cpu_per_iteration_s: CPU seconds the HTTP process spends per engine iteration (its
            step result received, unpacked, its metrics observed); on the engine's cores it
            lengthens the iteration it overlaps by as much.
        cpu_per_token_s: CPU seconds the HTTP process (its SSE event) and a load generator on
            the same machine spend per streamed token.
        cpu_per_request_s: the same per request (parse, tokenize, admit, end the stream),
            charged to the iteration that prefills its first chunk.
        request_latency_s: the way from the HTTP request to the engine and of the first
            token back, which no iteration covers (TTFT only).
    """

    cpu_per_iteration_s: float = Field(0.0, ge=0, le=MAX_SECONDS)
    cpu_per_token_s: float = Field(0.0, ge=0, le=MAX_SECONDS)
    cpu_per_request_s: float = Field(0.0, ge=0, le=MAX_SECONDS)
    request_latency_s: float = Field(0.0, ge=0, le=MAX_SECONDS)


class KVCacheSpec(_Strict):
    """The KV pool the profile's numbers were taken with (per replica, all ranks together)."""

    block_size: int = Field(ge=1, le=256)
    num_blocks: int = Field(ge=1, le=MAX_NUM_BLOCKS)
    kv_bytes_per_token: int = Field(ge=1, le=1 << 30, description="all layers, K and V, all ranks")


class SwapSpec(_Strict):
    bytes_per_s: float = Field(ge=1e3, description="device <-> host copy bandwidth")


class ModelSpec(_Strict):
    name: str
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: int = Field(ge=1, le=1 << 22)
    vocab_size: int = Field(ge=4, le=1 << 24)
    eos_token_ids: list[int] = Field(min_length=1)
    num_layers: int | None = None
    dtype: str = "bfloat16"


class OutputLengths(_Strict):
    """Where a simulated request draws its EOS (unless ``ignore_eos`` or ``max_tokens`` end
    it first): ``lognormal`` (``median``, ``sigma``), ``uniform`` (``min``..``max``) or
    ``constant`` (``median``), clipped to ``[min, max]`` tokens."""

    distribution: Literal["lognormal", "uniform", "constant"] = "lognormal"
    median: float = Field(200.0, gt=0, le=1 << 20)
    sigma: float = Field(0.8, ge=0, le=10)
    min: int = Field(1, ge=1, le=1 << 20)
    max: int = Field(2048, ge=1, le=1 << 20)


class FitError(_Strict):
    """Absolute percentage error of the forward model on held-out iterations."""

    median_abs_pct: float
    p90_abs_pct: float
    num_train: int
    num_held_out: int


class ProfileSource(_Strict):
    hardware: str
    date: str
    method: str
    fit_error: FitError | None = None
    references: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class LatencyProfile(_Strict):
    """A latency profile (the JSON file's schema)."""

    format_version: StrictInt = PROFILE_FORMAT_VERSION
    name: str
    model: ModelSpec
    iteration: IterationModel
    engine_overhead: EngineOverhead = Field(default_factory=EngineOverhead)
    serving: ServingCosts = Field(default_factory=ServingCosts)
    kv_cache: KVCacheSpec
    swap: SwapSpec
    output_lengths: OutputLengths = Field(default_factory=OutputLengths)
    source: ProfileSource

    def forward_seconds(self, shape: BatchShape) -> float:
        """Predicted forward time of one iteration of ``shape`` (seconds)."""
        m = self.iteration
        linear = m.per_decode_token_s * shape.num_decode_tokens
        linear += m.per_prefill_token_s * shape.num_prefill_tokens
        seconds = m.fixed_s + max(m.linear_floor_s, linear)
        seconds += m.per_context_token_s * shape.decode_context_tokens
        seconds += m.per_attention_pair_s * shape.prefill_attention_pairs
        seconds += m.per_prefill_seq_s * shape.num_prefill_seqs
        return seconds + self.swap_seconds(shape.num_swapped_blocks)

    def overhead_seconds(self, shape: BatchShape) -> float:
        """The engine's own time around the forward (seconds)."""
        o = self.engine_overhead
        return o.fixed_s + o.per_seq_s * shape.num_seqs

    def serving_seconds(self, shape: BatchShape) -> float:
        """The serving side's CPU on the engine's cores during an iteration of ``shape``
        (seconds): the iteration's result, its tokens' SSE events and its new requests (one
        per prefill chunk)."""
        s = self.serving
        num_tokens = shape.num_decode_tokens + shape.num_prefill_seqs
        seconds = s.cpu_per_iteration_s + s.cpu_per_token_s * num_tokens
        return seconds + s.cpu_per_request_s * shape.num_prefill_seqs

    def swap_seconds(self, num_blocks: int) -> float:
        """Time to copy ``num_blocks`` KV blocks one way (seconds)."""
        num_bytes = num_blocks * self.kv_cache.block_size * self.kv_cache.kv_bytes_per_token
        return num_bytes / self.swap.bytes_per_s

    def prefill_seconds_per_token(self) -> float:
        """Recompute cost per token, for the scheduler's swap-or-recompute choice."""
        return self.iteration.per_prefill_token_s

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"


@dataclass(frozen=True)
class BatchShape:
    """The features of one iteration the latency model uses (counts of tokens)."""

    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    decode_context_tokens: int = 0
    prefill_attention_pairs: float = 0.0
    num_seqs: int = 0
    num_swapped_blocks: int = 0
    num_prefill_seqs: int = 0

    @classmethod
    def of(cls, out: SchedulerOutput) -> BatchShape:
        """The shape of a scheduler's batch: a request scheduled for one token is a decode
        (reading ``seq_len`` tokens of context), more tokens make a prefill chunk."""
        decode = prefill = context = num_prefill_seqs = 0
        pairs = 0.0
        for s in out.scheduled:
            n = s.num_scheduled_tokens
            if n == 1:
                decode += 1
                context += s.seq_len
            else:
                prefill += n
                num_prefill_seqs += 1
                pairs += n * s.num_computed_tokens + n * (n + 1) / 2
        swapped = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        return cls(decode, prefill, context, pairs, len(out.scheduled), swapped, num_prefill_seqs)

    def features(self) -> tuple[float, float, float, float, float]:
        """(D, P, C, A, S_p), the fitted features in :class:`IterationModel`'s order."""
        return (
            float(self.num_decode_tokens),
            float(self.num_prefill_tokens),
            float(self.decode_context_tokens),
            self.prefill_attention_pairs,
            float(self.num_prefill_seqs),
        )


def profile_path(name: str) -> Path:
    """Where built-in profile ``name`` is stored in the package."""
    return Path(str(resources.files("iterserve.sim") / "profiles" / f"{name}.json"))


def load_profile(name_or_path: str | Path) -> LatencyProfile:
    """A built-in profile by name (:data:`BUILTIN_PROFILES`) or a profile JSON file.

    Raises:
        ProfileError: no such profile, unreadable JSON, or a schema violation.
    """
    text = str(name_or_path)
    path = profile_path(text) if text in BUILTIN_PROFILES else Path(text)
    try:
        data = path.read_text()
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path}: not a UTF-8 JSON file ({e.reason})") from e
    except OSError as e:
        raise ProfileError(
            f"no latency profile {text!r}: not a built-in ({', '.join(BUILTIN_PROFILES)}) "
            f"and not a readable file ({e.strerror})"
        ) from e
    try:
        profile = LatencyProfile.model_validate_json(data)
    except ValidationError as e:
        raise ProfileError(f"{path}: not a valid latency profile: {e}") from e
    if profile.format_version != PROFILE_FORMAT_VERSION:
        raise ProfileError(
            f"{path}: format_version {profile.format_version}; this iterserve reads "
            f"{PROFILE_FORMAT_VERSION}"
        )
    return profile


def abs_pct_errors(predicted: list[float], measured: list[float]) -> list[float]:
    """``|predicted - measured| / measured * 100`` per point."""
    return [abs(p - m) / m * 100 for p, m in zip(predicted, measured, strict=True) if m > 0]


def median_and_p90(values: list[float]) -> tuple[float, float]:
    return percentile(values, 50), percentile(values, 90)
