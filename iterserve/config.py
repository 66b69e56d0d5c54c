"""Frozen configuration dataclasses: the single source of CLI flags and ``LLM(...)`` keywords.

Every field of :class:`ModelConfig`, :class:`CacheConfig`, :class:`SchedulerConfig` and
:class:`ParallelConfig` is a keyword of ``LLM(...)`` and a flag of ``iterserve serve`` /
``iterserve generate`` (underscores become dashes, booleans get a ``--no-`` form). Invariants
are checked when a config is built; a bad value raises :class:`ConfigError` (a ``ValueError``).

Values discovered at start-up (the resolved ``max_model_len``, the number of KV blocks) are
not patched into these objects: :func:`resolve_max_model_len` returns a new config and the
block count is passed to constructors.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

DType = Literal["auto", "bfloat16", "float16", "float32"]
AttentionBackendName = Literal["auto", "cpu", "torch", "triton"]
Quantization = Literal["none", "int8", "q4"]
KVCacheDType = Literal["auto", "int8"]
PreemptionMode = Literal["auto", "recompute", "swap"]
SchedulingPolicy = Literal["priority", "fcfs"]
BatchingMode = Literal["continuous", "static"]

GiB = 1 << 30
# Bounds of aging_interval_s (seconds): below 1 ms aging is meaningless, above a year it is off.
MIN_AGING_INTERVAL_S = 1e-3
MAX_AGING_INTERVAL_S = 365 * 86400.0
# Most tenants with a label value of their own in the per-tenant metrics (each costs a
# histogram's series on every replica).
MAX_TENANT_LABEL_LIMIT = 1000
# The API name of the embedded default model (``--model default``).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A configuration value or combination of values is invalid."""


def _check_types(cfg: Any) -> None:
    """Raise ConfigError when a field's value does not have its annotated type.

    ``Literal`` fields must hold one of their choices; ``int`` fields an int (not a bool);
    ``float`` fields an int or float; ``bool`` and ``str`` fields exactly that; ``X | None``
    also None. Other annotations (tuples of tiers) are checked by the class itself.
    """
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        tp = hints[f.name]
        args = typing.get_args(tp)
        if (isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union) and (
            type(None) in args
        ):
            if value is None:
                continue
            tp = next(a for a in args if a is not type(None))
        choices = _literal_choices(tp)
        if choices is not None:
            if value not in choices:
                raise ConfigError(f"{f.name} must be one of {list(choices)}, got {value!r}")
        elif tp in _SCALAR_CHECKS and not _SCALAR_CHECKS[tp](value):
            raise ConfigError(f"{f.name} must be {_SCALAR_NAMES[tp]}, got {value!r}")


_SCALAR_CHECKS: dict[Any, Any] = {
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v == v,
    bool: lambda v: isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}
_SCALAR_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _literal_choices(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(
        default="default",
        metadata={"help": "'default' (SmolLM2-135M-Instruct), a Hugging Face directory or a .gguf"},
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model id in the API (default: SmolLM2-135M-Instruct)"}
    )
    dtype: DType = field(default="auto", metadata={"help": "auto = bfloat16"})
    seed: int = field(default=0, metadata={"help": "seed of the sampler's default generator"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "tokens per sequence (default: the model's maximum)"}
    )
    attention_backend: AttentionBackendName = field(
        default="auto",
        metadata={
            "help": "auto: Triton on CUDA (triton), the fused C kernels on CPU (cpu) where "
            "they build, else torch; triton on a CPU only under TRITON_INTERPRET=1 (tests)"
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={"help": "no CUDA graphs: run decode iterations eagerly (CUDA with triton only)"},
    )
    quantization: Quantization = field(
        default="none",
        metadata={
            "help": "linear layers on CPUs: none (bfloat16), int8 (W8A8: int8 weights per "
            "channel, activations per token) or q4 (a GGUF's own Q4_1 weights); each batch "
            "size on the kernel measured fastest at start (docs/engine.md)"
        },
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _require(
            self.max_model_len is None or self.max_model_len > 0,
            f"max_model_len must be positive, got {self.max_model_len}",
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "exact number of KV blocks in the pool"}
    )
    kv_cache_memory: int | None = field(
        default=None, metadata={"help": "bytes for the KV pool (default 1 GiB on CPU)"}
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "fraction of GPU memory to use (CUDA only)"}
    )
    swap_space: float = field(default=0.0, metadata={"help": "GiB of host memory for swap"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached prefixes"})
    kv_cache_dtype: KVCacheDType = field(
        default="auto",
        metadata={
            "help": "auto: the model's dtype; int8: each cached key and value row as int8 "
            "with its scale (about half the bytes of bfloat16: decode attention reads less, "
            "the same memory holds 1.9x the tokens); the cpu and torch attention backends "
            "(docs/engine.md)"
        },
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
            f"block_size must be a power of two in [1, 256], got {self.block_size}",
        )
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}",
        )
        _require(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            f"kv_cache_memory must be positive, got {self.kv_cache_memory}",
        )
        _require(
            self.num_kv_blocks is None or self.kv_cache_memory is None,
            "give at most one of num_kv_blocks and kv_cache_memory",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(self.swap_space >= 0, f"swap_space must be >= 0, got {self.swap_space}")


MAX_TIER_NAME_LEN = 63  # the CRD's bound
# Priorities (a request's, a tier's) are within (-2**53, 2**53): exact as JSON numbers and as
# floats, so that admission's wait estimate ((priority - theirs) * aging_interval_s) cannot
# overflow (an unbounded one was an OverflowError, a 500, for every later request).
MAX_JSON_INT = 2**53


@dataclass(frozen=True)
class Tier:
    """A priority tier: requests whose priority maps here are labelled ``name`` in metrics.

    ``max_queue_wait_ms`` and ``ttft_target_ms`` (None = no limit) are used by admission
    control in the server.
    """

    name: str
    priority: int
    max_queue_wait_ms: float | None = None
    ttft_target_ms: float | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        _require(bool(self.name.strip()), "a tier needs a non-empty name")
        # Names label metrics and log lines: printable, and as short as the CRD allows.
        _require(
            len(self.name) <= MAX_TIER_NAME_LEN
            and all(unicodedata.category(c)[0] != "C" for c in self.name),
            f"tier name {self.name!r} must be at most {MAX_TIER_NAME_LEN} printable "
            "characters (no control or format characters)",
        )
        _require(
            isinstance(self.priority, int)
            and not isinstance(self.priority, bool)
            and abs(self.priority) < MAX_JSON_INT,
            f"tier {self.name!r}: priority must be an integer in (-2**53, 2**53), "
            f"got {self.priority!r}",
        )
        for name in ("max_queue_wait_ms", "ttft_target_ms"):
            value = getattr(self, name)
            _require(
                value is None or 0 < value < math.inf,
                f"tier {self.name!r}: {name} must be a positive number of ms, got {value!r}",
            )


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier("premium", 0),
    Tier("standard", 1),
    Tier("best-effort", 2),
)
DEFAULT_TIER_NAME = "standard"


# Tiers are few by nature (the CRD allows 32): a bound keeps the per-tier metric series and
# the admission scan small whatever an admin PUTs.
MAX_TIERS = 32


def parse_tiers(data: object) -> tuple[Tier, ...]:
    """Tiers from a list of mappings (YAML/JSON): ``[{name, priority, ...}, ...]``.

    Raises:
        ConfigError: malformed entries, or more than :data:`MAX_TIERS` of them.
    """
    if not isinstance(data, list | tuple) or not data:
        raise ConfigError("tiers must be a non-empty list of {name, priority, ...}")
    if len(data) > MAX_TIERS:
        raise ConfigError(f"at most {MAX_TIERS} tiers, got {len(data)}")
    tiers = []
    for entry in data:
        if isinstance(entry, Tier):
            tiers.append(entry)
            continue
        if not isinstance(entry, dict):
            raise ConfigError(f"a tier must be a mapping, got {entry!r}")
        fields = {f.name for f in dataclasses.fields(Tier)}
        if unknown := sorted(str(k) for k in entry if k not in fields):
            raise ConfigError(
                f"bad tier {entry!r}: unknown keys {unknown} (known: {sorted(fields)})"
            )
        if missing := [k for k in ("name", "priority") if k not in entry]:
            raise ConfigError(f"bad tier {entry!r}: {' and '.join(missing)} required")
        tiers.append(Tier(**entry))
    return tuple(tiers)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=128, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(
        default=256, metadata={"help": "token budget of one iteration"}
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "split long prefills across iterations"}
    )
    long_prefill_token_threshold: int = field(
        default=0,
        metadata={"help": "most prefill tokens of one request per iteration (0 = budget)"},
    )
    kv_watermark: float = field(
        default=0.01, metadata={"help": "fraction of KV blocks kept free at admission"}
    )
    preemption_mode: PreemptionMode = field(
        default="auto", metadata={"help": "how a preempted request gives back its KV blocks"}
    )
    scheduling_policy: SchedulingPolicy = field(
        default="priority", metadata={"help": "order of the waiting queue"}
    )
    batching: BatchingMode = field(default="continuous", metadata={"help": "batching policy"})
    aging_interval_s: float = field(
        default=5.0, metadata={"help": "seconds waited per step of priority gained"}
    )
    priority_preemption_margin: int = field(
        default=1,
        metadata={
            "help": "preempt a running request for a waiting one at least this many priority "
            "steps more urgent (0 = off)"
        },
    )
    max_waiting: int = field(
        default=1024,
        metadata={"help": "most requests queued before the server answers 429 (server only)"},
    )
    max_waiting_per_tenant: int | None = field(
        default=None,
        metadata={
            "help": "most requests one tenant (X-Tenant-Id, else the OpenAI user field) may "
            "have queued before its new ones get 429 tenant_queue_full; the default tenant is "
            "not capped; at most max_waiting (default: no cap; server only)"
        },
    )
    tiers: tuple[Tier, ...] = field(
        default=DEFAULT_TIERS,
        metadata={"help": "YAML file: list of {name, priority, max_queue_wait_ms, ttft_target_ms}"},
    )

    def __post_init__(self) -> None:
        _check_types(self)
        object.__setattr__(self, "tiers", parse_tiers(self.tiers))
        _require(
            MIN_AGING_INTERVAL_S <= self.aging_interval_s <= MAX_AGING_INTERVAL_S,
            f"aging_interval_s must be in [{MIN_AGING_INTERVAL_S}, {MAX_AGING_INTERVAL_S:g}] "
            f"seconds, got {self.aging_interval_s}",
        )
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "long_prefill_token_threshold",
            "max_waiting",
            "max_waiting_per_tenant",
        ):
            # Exact in JSON and storable in SQLite (telemetry's scheduler_config rows).
            value = getattr(self, name)
            _require(
                value is None or value < MAX_JSON_INT,
                f"{name} must be below 2**53, got {value}",
            )
        _require(
            0 <= self.priority_preemption_margin < 2**53,
            f"priority_preemption_margin must be in [0, 2**53) (0 = off), "
            f"got {self.priority_preemption_margin}",
        )
        _require(self.max_waiting >= 1, f"max_waiting must be >= 1, got {self.max_waiting}")
        _require(
            self.max_waiting_per_tenant is None or self.max_waiting_per_tenant >= 1,
            f"max_waiting_per_tenant must be in [1, max_waiting={self.max_waiting}] "
            f"(null = no cap), got {self.max_waiting_per_tenant}",
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            f"long_prefill_token_threshold must be >= 0 (0 = the iteration's budget), "
            f"got {self.long_prefill_token_threshold}",
        )
        _require(
            0.0 <= self.kv_watermark < 1.0,
            f"kv_watermark must be in [0, 1), got {self.kv_watermark}",
        )
        check_rules(field_values(self))

    def tier_for(self, priority: int) -> Tier:
        """The tier with the largest priority <= ``priority`` (the most urgent tier if none)."""
        below = [t for t in self.tiers if t.priority <= priority]
        if below:
            return max(below, key=lambda t: t.priority)
        return min(self.tiers, key=lambda t: t.priority)

    def tier_named(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "model shards per replica, one process and device each (with --simulate: "
            "the profile's degree)"
        },
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _require(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}",
        )


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the HTTP server (``iterserve serve`` only; not ``LLM(...)`` keywords)."""

    host: str = field(default="0.0.0.0", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port"})
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "Bearer key for /v1/*, /tokenize, /detokenize, /version (env ITERSERVE_API_KEY)"
        },
    )
    admin_token: str | None = field(
        default=None,
        metadata={"help": "Bearer token enabling /admin/* (env ITERSERVE_ADMIN_TOKEN)"},
    )
    admin_token_file: str | None = field(
        default=None,
        metadata={
            "help": "file of Bearer tokens enabling /admin/*, one per line, each accepted; "
            "read again when it changes (a rotated Kubernetes Secret)"
        },
    )
    admin_port: int | None = field(
        default=None,
        metadata={
            "help": "serve /admin/* on this port only, a second listener on --host (/admin/* "
            "on --port is then 404, and this port serves nothing else); default: on --port"
        },
    )
    shutdown_grace_period_s: float = field(
        default=30.0, metadata={"help": "seconds running requests get to finish after SIGTERM"}
    )
    max_request_body_bytes: int = field(
        default=4 << 20, metadata={"help": "larger request bodies are answered 413"}
    )
    log_prompts: bool = field(
        default=False, metadata={"help": "put prompt text into the access log"}
    )
    config_version: int = field(
        default=1,
        metadata={
            "help": "version of the live scheduler settings at start (the operator's "
            "ConfigMap sets it to the resource's generation)"
        },
    )
    stream_stall_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "a streaming client that takes no bytes for this long is disconnected and "
            "its request aborted (0: wait forever)"
        },
    )
    engine_hang_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "the engine process is declared hung and killed (the server then exits "
            "with code 1, as when it dies) after sending nothing for this long; an idle "
            "engine is probed (0: never)"
        },
    )
    max_stream_buffer_chunks: int = field(
        default=1024,
        metadata={
            "help": "chunks a stream may hold unsent while its client reads slower than the "
            "engine writes; past it the client is disconnected and its request aborted"
        },
    )
    telemetry_db: str | None = field(
        default=None,
        metadata={
            "help": "SQLite file for the telemetry tables (sequences, scheduler_iterations, "
            "scheduler_config), written off the hot path; read it with iterserve report "
            "(default: off)"
        },
    )
    tenant_label_limit: int = field(
        default=20,
        metadata={
            "help": "tenants that keep their name in the per-tenant metrics' tenant label: the "
            "first ones seen; later ones are 'other' (0 = all but 'default' are 'other')"
        },
    )
    api_keys_file: str | None = field(
        default=None,
        metadata={
            "help": "YAML list of {key, tenant, tiers, default_tier}: clients may also send "
            "these keys, each request then of its key's tenant and tiers (re-read on change)"
        },
    )
    router_token_file: str | None = field(
        default=None,
        metadata={
            "help": "file holding the router's token: requests bearing it are trusted for "
            "X-Tenant-Id and the router's tier headers, no others are (re-read on change)"
        },
    )
    kv_events_port: int = field(
        default=0,
        metadata={
            "help": "publish KV-cache events in vLLM's format (ZMQ PUB on --host:PORT, topic "
            "kv@<pod>@<model>) for prefix-aware routers, e.g. 5557 (vLLM's); 0 = off (default)"
        },
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _require(
            0 <= self.tenant_label_limit <= MAX_TENANT_LABEL_LIMIT,
            f"tenant_label_limit must be in [0, {MAX_TENANT_LABEL_LIMIT}], "
            f"got {self.tenant_label_limit}",
        )
        _require(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        _require(
            0 <= self.kv_events_port <= 65535,
            f"kv_events_port must be in [0, 65535], got {self.kv_events_port}",
        )
        _require(
            self.admin_port is None
            or (1 <= self.admin_port <= 65535 and self.admin_port != self.port),
            f"admin_port must be in [1, 65535] and differ from port, got {self.admin_port}",
        )
        _require(
            self.shutdown_grace_period_s >= 0,
            f"shutdown_grace_period_s must be >= 0, got {self.shutdown_grace_period_s}",
        )
        _require(
            self.max_request_body_bytes >= 1024,
            f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}",
        )
        _require(
            self.stream_stall_timeout_s >= 0,
            f"stream_stall_timeout_s must be >= 0, got {self.stream_stall_timeout_s}",
        )
        _require(
            self.engine_hang_timeout_s >= 0,
            f"engine_hang_timeout_s must be >= 0, got {self.engine_hang_timeout_s}",
        )
        _require(
            self.max_stream_buffer_chunks >= 1,
            f"max_stream_buffer_chunks must be >= 1, got {self.max_stream_buffer_chunks}",
        )
        _require(
            0 <= self.config_version < 2**53,
            f"config_version must be in [0, 2**53), got {self.config_version}",
        )


@dataclass(frozen=True)
class SimulationConfig:
    """``iterserve serve --simulate``: a simulated replica (``iterserve.sim``); not ``LLM(...)``
    keywords."""

    simulate: str | None = field(
        default=None,
        metadata={
            "help": "serve over the simulated model runner with this latency profile (a JSON "
            "file, or cpu-smollm2 / a100x4-llama3-70b); no torch is loaded"
        },
    )
    simulate_speed: float = field(
        default=1.0,
        metadata={"help": "run X times faster than the profile (metrics report profile time)"},
    )
    simulate_output_len: str | None = field(
        default=None,
        metadata={
            "help": "where simulated requests draw EOS: constant:N, uniform:MIN:MAX or "
            "lognormal:MEDIAN:SIGMA[:MAX] (default: the profile's)"
        },
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _require(
            1e-3 <= self.simulate_speed <= 1e6,
            f"simulate_speed must be in [0.001, 1e6], got {self.simulate_speed}",
        )


# ----------------------------------------------------------------- rules across settings


@dataclass(frozen=True)
class Rule:
    """A rule relating several settings, written once in Python and once in CEL.

    The server checks it with :meth:`holds` (:func:`check_rules`); the operator checks it on
    an ``LLMDeployment`` spec and puts it into the CRD as a CEL rule (Kubernetes' validation
    language), with its fields renamed to the spec's paths (:meth:`renamed`).

    Attributes:
        fields: the settings it reads, in the order :attr:`check` takes their values.
        check: the predicate, True when the values are valid together; an optional field
            (``X | None``) may be None, a ``tiers`` value is a sequence of objects with
            ``name`` and ``priority``.
        cel: the same predicate in CEL, each field written ``{field}``; a None field is
            absent in CEL (test it with ``has({field})``), a float field is a CEL double.
        message: why values break it, each field written ``{field}``.
    """

    fields: tuple[str, ...]
    check: Callable[..., bool]
    cel: str
    message: str

    def holds(self, values: Mapping[str, Any]) -> bool:
        """Whether ``values`` (field -> value; every field of the rule) satisfy it."""
        return bool(self.check(*(values[name] for name in self.fields)))

    def explain(self, values: Mapping[str, Any] | None = None) -> str:
        """:attr:`message` with the fields named, then their ``values`` if given."""
        text = fill(self.message, {name: name for name in self.fields})
        if values is None:
            return text
        shown = ", ".join(f"{name}={_shown(values[name])}" for name in self.fields)
        return f"{text} (got {shown})"

    def renamed(self, names: Mapping[str, str]) -> Rule:
        """The same rule with its fields called ``names[field]`` (in CEL and message too)."""
        placeholders = {name: "{" + names[name] + "}" for name in self.fields}
        return Rule(
            fields=tuple(names[name] for name in self.fields),
            check=self.check,
            cel=fill(self.cel, placeholders),
            message=fill(self.message, placeholders),
        )


_PLACEHOLDER = re.compile(r"\{([\w.]+)\}")


def fill(template: str, names: Mapping[str, str]) -> str:
    """``template`` with every ``{field}`` replaced by ``names[field]``.

    Raises:
        KeyError: a placeholder ``names`` does not name.
    """
    return _PLACEHOLDER.sub(lambda match: names[match[1]], template)


def _shown(value: Any) -> str:
    if isinstance(value, tuple) and value and all(isinstance(t, Tier) for t in value):
        return repr([(t.name, t.priority) for t in value])  # what the tier rules read
    return repr(value)


# The rules across settings: checked by SchedulerConfig (its own fields), EngineConfig (all
# of them), a live PUT's merge, and the operator on an LLMDeployment spec (in Python and in
# the CRD's CEL). Each field alone is checked by its config class first.
CROSS_FIELD_RULES: tuple[Rule, ...] = (
    Rule(
        fields=("max_num_batched_tokens", "max_num_seqs"),
        check=lambda batched, seqs: batched >= seqs,
        cel="{max_num_batched_tokens} >= {max_num_seqs}",
        message="{max_num_batched_tokens} must be >= {max_num_seqs}: every running request "
        "needs a decode token",
    ),
    Rule(
        fields=("long_prefill_token_threshold", "max_num_batched_tokens"),
        check=lambda threshold, batched: threshold <= batched,
        cel="{long_prefill_token_threshold} <= {max_num_batched_tokens}",
        message="{long_prefill_token_threshold} must be <= {max_num_batched_tokens}",
    ),
    Rule(
        fields=("enable_chunked_prefill", "long_prefill_token_threshold"),
        check=lambda chunked, threshold: chunked or threshold == 0,
        cel="{enable_chunked_prefill} || {long_prefill_token_threshold} == 0",
        message="{long_prefill_token_threshold} splits prompts, so it needs chunked prefill "
        "({enable_chunked_prefill}): without it a prompt is prefilled whole",
    ),
    Rule(
        fields=("quantization", "dtype"),
        check=lambda quantization, dtype: quantization == "none" or dtype in ("auto", "bfloat16"),
        cel="{quantization} == 'none' || {dtype} == 'auto' || {dtype} == 'bfloat16'",
        message="{quantization} computes in bfloat16: {dtype} must be auto or bfloat16",
    ),
    Rule(
        fields=("quantization", "tensor_parallel_size"),
        check=lambda quantization, size: quantization != "q4" or size == 1,
        cel="{quantization} != 'q4' || {tensor_parallel_size} == 1",
        message="{quantization} q4 serves one shard: {tensor_parallel_size} must be 1 (int8 "
        "shards)",
    ),
    Rule(
        fields=("max_waiting_per_tenant", "max_waiting"),
        check=lambda cap, waiting: cap is None or cap <= waiting,
        cel="!has({max_waiting_per_tenant}) || {max_waiting_per_tenant} <= {max_waiting}",
        message="{max_waiting_per_tenant} must be <= {max_waiting}",
    ),
    Rule(
        fields=("tiers",),
        check=lambda tiers: len({t.name for t in tiers}) == len(tiers),
        cel="{tiers}.all(t, {tiers}.exists_one(u, u.name == t.name))",
        message="tier names must be unique in {tiers}",
    ),
    Rule(
        fields=("tiers",),
        check=lambda tiers: len({t.priority for t in tiers}) == len(tiers),
        cel="{tiers}.all(t, {tiers}.exists_one(u, u.priority == t.priority))",
        message="tier priorities must be unique in {tiers}",
    ),
    Rule(
        fields=("preemption_mode", "swap_space"),
        check=lambda mode, swap_space: mode != "swap" or swap_space > 0,
        cel="{preemption_mode} != 'swap' || {swap_space} > 0.0",
        message="{preemption_mode} swap needs swap space: {swap_space} > 0",
    ),
    Rule(
        fields=("enable_chunked_prefill", "max_model_len", "max_num_batched_tokens"),
        check=lambda chunked, max_model_len, batched: (
            chunked or max_model_len is None or batched >= max_model_len
        ),
        cel="{enable_chunked_prefill} || !has({max_model_len})"
        " || {max_num_batched_tokens} >= {max_model_len}",
        message="without chunked prefill ({enable_chunked_prefill}) a prompt is prefilled "
        "whole, so {max_num_batched_tokens} must be >= {max_model_len}",
    ),
)


def field_values(config: Any) -> dict[str, Any]:
    """A config dataclass's fields as a mapping (values as they are, not copied)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def check_rules(values: Mapping[str, Any]) -> None:
    """Check every rule of :data:`CROSS_FIELD_RULES` whose fields ``values`` all has.

    Raises:
        ConfigError: the first rule broken, its fields named with their values.
    """
    for rule in CROSS_FIELD_RULES:
        if all(name in values for name in rule.fields) and not rule.holds(values):
            raise ConfigError(rule.explain(values))


# Scheduler settings that a running server may change (PUT /admin/scheduler_config).
LIVE_SCHEDULER_KEYS: tuple[str, ...] = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "kv_watermark",
    "preemption_mode",
    "aging_interval_s",
    "priority_preemption_margin",
    "max_waiting",
    "max_waiting_per_tenant",
    "tiers",
)


ENGINE_CONFIG_CLASSES: tuple[type, ...] = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
)


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings, checked together (cross-config invariants live here)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        parts = (self.model, self.cache, self.scheduler, self.parallel)
        check_rules({name: value for part in parts for name, value in field_values(part).items()})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keywords (``LLM(...)`` and CLI names).

        Raises:
            TypeError: for a keyword that is no field of any engine config.
            ConfigError: for invalid values.
        """
        parts: dict[str, dict[str, Any]] = {}
        names = {"model": ModelConfig, "cache": CacheConfig}
        names |= {"scheduler": SchedulerConfig, "parallel": ParallelConfig}
        owner = {f.name: part for part, c in names.items() for f in dataclasses.fields(c)}
        for key, value in kwargs.items():
            if key not in owner:
                raise TypeError(f"unexpected keyword argument {key!r}")
            parts.setdefault(owner[key], {})[key] = value
        return cls(**{part: names[part](**parts.get(part, {})) for part in names})

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """A new config whose ``model.max_model_len`` is set (resolved from the model)."""
        return dataclasses.replace(
            self, model=dataclasses.replace(self.model, max_model_len=max_model_len)
        )


def field_type(cls: type, name: str) -> Any:
    """The resolved annotation of a config field, with ``X | None`` unwrapped to ``X``."""
    tp = typing.get_type_hints(cls)[name]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0]
    return tp


def read_tiers_file(path: Path) -> list[dict[str, Any]]:
    """``--tiers FILE``: a YAML list of ``{name, priority, max_queue_wait_ms, ttft_target_ms}``.

    Raises:
        ValueError: unreadable, or not a list.
    """
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read tiers from {path}: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of tiers")
    return data


def load_config_file(path: Path, known: set[str] | None = None) -> dict[str, Any]:
    """The settings of a ``--config`` YAML file (keys with dashes or underscores), as keywords
    (a ``tiers`` value may name a tiers file).

    Args:
        known: accepted keyword names (default: every engine config field).

    Raises:
        ValueError: unreadable file, not a mapping, or an unknown setting.
    """
    import yaml

    if known is None:
        known = {f.name for cls in ENGINE_CONFIG_CLASSES for f in dataclasses.fields(cls)}
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read --config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of flags to values")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ValueError(f"{path}: unknown setting {key!r}")
        if name == "tiers" and isinstance(value, str):  # a file, as --tiers takes
            value = read_tiers_file(Path(value))
        kwargs[name] = value
    return kwargs
