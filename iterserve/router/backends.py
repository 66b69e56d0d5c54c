"""Reading a replica's load: iterserve's ``/load``, or the Prometheus ``/metrics`` of vLLM and
SGLang replicas (the Gateway API Inference Extension's model-server protocol), so one router
serves a mixed fleet.

=========  ===============  ==================================================================
type       endpoint         fields
=========  ===============  ==================================================================
iterserve  ``GET /load``    ``kv_cache_usage`` (0-1), ``num_waiting``, ``num_running``,
                            ``num_total_blocks`` (JSON)
vllm       ``GET /metrics`` ``vllm:kv_cache_usage_perc`` (0-1; older vLLM:
                            ``vllm:gpu_cache_usage_perc``), ``vllm:num_requests_waiting``,
                            ``vllm:num_requests_running``, ``vllm:cache_config_info``'s
                            ``num_gpu_blocks`` label
sglang     ``GET /metrics`` ``sglang:token_usage`` (0-1), ``sglang:num_queue_reqs``,
                            ``sglang:num_running_reqs``
=========  ===============  ==================================================================

Series with several label sets (one per served model, or per data-parallel rank: SGLang's
``dp_rank``) are summed (queues) or averaged (usage). SGLang with priority scheduling also
exports a series per priority next to the total (``priority=""``): only the total counts.
SGLang serves ``/metrics`` only when started with ``--enable-metrics``.

``auto`` asks ``/load`` first and takes it when it has iterserve's shape (vLLM also answers
``GET /load``, with ``{"server_load": N}``; SGLang has none), else reads ``/metrics``; it
remembers what worked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

from iterserve.router.scoring import LoadReport

BackendType = Literal["auto", "iterserve", "vllm", "sglang"]
BACKEND_TYPES = ("auto", "iterserve", "vllm", "sglang")

# (usage names, waiting, running) per server type, first present wins.
_PROMETHEUS_NAMES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        ("vllm:num_requests_waiting",),
        ("vllm:num_requests_running",),
    ),
    "sglang": (("sglang:token_usage",), ("sglang:num_queue_reqs",), ("sglang:num_running_reqs",)),
}


class LoadFormatError(ValueError):
    """A replica's answer does not carry the load fields of its type."""


def _count(value: Any, name: str) -> int:
    """A non-negative finite count (a replica's numbers are not trusted blindly)."""
    number = float(value)
    if not 0 <= number < 1e12:
        raise LoadFormatError(f"{name} = {value!r} is not a count")
    return int(number)


def _usage(value: Any) -> float:
    number = float(value)
    if not 0 <= number <= 1.0 + 1e-9:
        raise LoadFormatError(f"KV usage {value!r} is not a fraction in [0, 1]")
    return min(number, 1.0)


def parse_iterserve_load(data: Any, received_at: float) -> LoadReport:
    """``/load``'s JSON as a report.

    Raises:
        LoadFormatError: not an object with the fields above, or values out of range.
    """
    try:
        return LoadReport(
            kv_cache_usage=_usage(data["kv_cache_usage"]),
            num_waiting=_count(data["num_waiting"], "num_waiting"),
            num_running=_count(data["num_running"], "num_running"),
            num_total_blocks=_count(data.get("num_total_blocks", 0), "num_total_blocks"),
            received_at=received_at,
            draining=data.get("draining") is True,
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise LoadFormatError(f"not an iterserve /load answer: {e!r}") from e


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def _first(samples: dict[str, Any], names: Iterable[str]) -> list[float] | None:
    for name in names:
        if name in samples:
            series = samples[name]
            if any("priority" in labels for labels, _ in series):  # SGLang: "" is the total
                series = [(labels, v) for labels, v in series if labels.get("priority") == ""]
            return [v for _, v in series]
    return None


def detect_prometheus_type(text: str) -> str | None:
    """``vllm`` or ``sglang`` from the metric names present, else None."""
    samples = _samples(text)
    for kind, (usage, waiting, _running) in _PROMETHEUS_NAMES.items():
        if _first(samples, waiting) is not None and _first(samples, usage) is not None:
            return kind
    return None


def parse_prometheus_load(text: str, kind: str, received_at: float) -> LoadReport:
    """A vLLM or SGLang replica's ``/metrics`` text as a report.

    Raises:
        LoadFormatError: the names of ``kind`` are missing, or the text is not Prometheus'.
    """
    try:
        samples = _samples(text)
    except ValueError as e:
        raise LoadFormatError(f"not Prometheus text: {e}") from e
    usage_names, waiting_names, running_names = _PROMETHEUS_NAMES[kind]
    usage = _first(samples, usage_names)
    waiting = _first(samples, waiting_names)
    running = _first(samples, running_names)
    if usage is None or waiting is None or running is None:
        raise LoadFormatError(f"no {kind} load metrics ({usage_names[0]}, {waiting_names[0]})")
    num_blocks = 0
    for labels, _ in samples.get("vllm:cache_config_info", []):
        if labels.get("num_gpu_blocks", "").isdigit():
            num_blocks += int(labels["num_gpu_blocks"])
    try:
        return LoadReport(
            kv_cache_usage=_usage(sum(usage) / len(usage) if usage else 0.0),
            num_waiting=_count(sum(waiting), waiting_names[0]),
            num_running=_count(sum(running), running_names[0]),
            num_total_blocks=num_blocks,
            received_at=received_at,
        )
    except (ValueError, OverflowError) as e:
        raise LoadFormatError(f"bad {kind} load metrics: {e}") from e
