"""The table ``python -m benchmarks.gpu`` prints: one headline per section, then its details."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _ratio(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _kernel_checks(r: dict[str, Any]) -> list[str]:
    lines = [f"{r['num_checks'] - r['num_failed']}/{r['num_checks']} checks passed"]
    for c in r["checks"]:
        err = c.get("max_abs_error")
        detail = f"max |err| {err:.2e}" if err is not None else ""
        if not c["passed"]:
            detail = f"FAILED {c['error'][:160]}"
        lines.append(f"  {c['kernel']:<16} {c['case']:<28} {c['dtype']:<9} {detail}")
    return lines


def _attention_bandwidth(r: dict[str, Any]) -> list[str]:
    s = r["shape"]
    lines = [
        f"copy {r['copy_bandwidth_gb_s']:.0f} GB/s; heads {s['num_heads']}/{s['num_kv_heads']}, "
        f"head_dim {s['head_dim']}, block {s['block_size']}, {s['dtype']}; target "
        f"{r['target']}: {_ratio(r['target_ratio'])} (met: {r['target_met']})",
        f"  {'batch':>6} {'context':>8} {'splits':>6} {'ms':>9} {'GB/s':>8} {'vs copy':>8}",
    ]
    for row in r["rows"]:
        lines.append(
            f"  {row['batch']:>6} {row['context']:>8} {row['num_splits']:>6} {row['ms']:>9.3f} "
            f"{row['bandwidth_gb_s']:>8.0f} {row['vs_copy']:>8.2f}"
        )
    return lines


def _model_line(m: dict[str, Any]) -> str:
    return (
        f"model: hidden {m['hidden_size']}, {m['num_layers']} layers, heads "
        f"{m['num_heads']}/{m['num_kv_heads']}, inter {m['intermediate_size']}, vocab "
        f"{m['vocab_size']}, {m['dtype']}, {m['weight_bytes'] / 2**30:.2f} GiB, {m['platform']}"
    )


def _offline(r: dict[str, Any]) -> list[str]:
    ours, theirs, w = r["iterserve"], r["transformers"], r["workload"]
    timed_out = " (timed out: finished requests only)" if theirs["timed_out"] else ""
    return [
        f"iterserve / transformers = {_ratio(r['ratio'])}x (target {r['target']}; met: "
        f"{r['target_met']})",
        "  " + _model_line(r["model"]),
        f"  workload: {w['num_requests']} requests, prompt {w['prompt_len']}, output "
        f"{w['output_len']} tokens",
        f"  iterserve:    {ours['generated_tokens']:>7} tokens {ours['seconds']:>7.1f} s "
        f"{ours['tokens_per_s']:>8.0f} tok/s ({ours['iterations']} iterations)",
        f"  transformers: {theirs['generated_tokens']:>7} tokens {theirs['seconds']:>7.1f} s "
        f"{theirs['tokens_per_s']:>8.0f} tok/s ({theirs['version']}, "
        f"{theirs['attn_implementation']}){timed_out}",
        f"  first-token agreement {_ratio(r['first_token_agreement'])}",
    ]


def _decode_floor(r: dict[str, Any]) -> list[str]:
    return [
        f"iteration {r['iteration_ms']:.2f} ms vs floor {r['floor_ms']:.2f} ms = "
        f"{r['vs_floor']:.2f}x (target {r['target']}; met: {r['target_met']})",
        "  " + _model_line(r["model"]),
        f"  batch {r['batch']}, context {r['context']}, {r['num_steps']} steps; reads "
        f"{r['weight_bytes_read'] / 2**30:.2f} GiB weights + {r['kv_bytes_read'] / 2**30:.2f} "
        f"GiB KV at {r['copy_bandwidth_gb_s']:.0f} GB/s",
    ]


def _engine_parity(r: dict[str, Any]) -> list[str]:
    lines = [f"{r['num_mismatches']} mismatching completions ({r['device']}, {r['backend']})"]
    for name, run in r["runs"].items():
        c = run["counters"]["device"]
        lines.append(
            f"  {name:<9}: {run['num_completions']} completions, {len(run['mismatches'])} "
            f"differ; preemptions recompute {c['preemptions_recompute']} swap "
            f"{c['preemptions_swap']}; prefix hits {c['prefix_cache_hit_tokens']} tokens; max "
            f"logprob diff {run['max_logprob_diff']:.2e}"
        )
    return lines


_FORMATTERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "kernel_checks": _kernel_checks,
    "attention_bandwidth": _attention_bandwidth,
    "offline_throughput": _offline,
    "decode_floor": _decode_floor,
    "engine_parity": _engine_parity,
}


def format_report(report: dict[str, Any]) -> str:
    """The report of :func:`benchmarks.gpu.main` as text."""
    env = report["environment"]
    lines = [
        f"benchmarks.gpu{' --quick' if report['quick'] else ''}: "
        f"{env.get('device_name', env['device'])}, torch {env['torch']}, triton "
        f"{env['triton']}, transformers {env['transformers']}, {report['wall_s']:.0f} s"
    ]
    if report.get("note"):
        lines.append(report["note"])
    preflight = report.get("triton_preflight")
    if preflight and not preflight.get("ok"):
        lines.append(f"triton preflight FAILED: {preflight.get('error', '')[:300]}")
    for name, entry in sorted(report["sections"].items(), key=lambda kv: kv[1]["section"]):
        lines.extend(format_section(name, entry))
    return "\n".join(lines)


def format_section(name: str, entry: dict[str, Any]) -> list[str]:
    """One section's headline and details (``entry`` as in the report's ``sections``)."""
    lines = [f"[{entry['section']}] {name} ({entry['status']}, {entry['seconds']:.1f} s)"]
    if entry["status"] != "ok":
        lines.append(f"  error: {entry['error'][:300]}")
    if "result" in entry:
        try:
            lines.extend("  " + line for line in _FORMATTERS[name](entry["result"]))
        except Exception as e:  # a table bug must not stop the run: the JSON has it all
            lines.append(f"  (no table: {e!r})")
    return lines
