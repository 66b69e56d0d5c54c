"""Helpers every benchmark shares (torch-free)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def warn_if_loaded() -> None:
    """Benchmarks on 2 cores are easily polluted: say so when something else is running."""
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} on {os.cpu_count()} cores; timings will be noisy")


def output_dir(args: argparse.Namespace) -> Path:
    if args.output_dir is not None:
        return Path(args.output_dir)
    return Path("bench-results") / "smoke" if args.smoke else Path("bench-results")


# The instruction sets a CPU figure depends on (bfloat16 and int8 dot products, AMX tiles).
CPU_FEATURES = (
    "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8",
)  # fmt: skip


def cpu_capabilities() -> str:
    """One line saying what a CPU figure ran on: the CPU model, the matrix instructions it has
    (of :data:`CPU_FEATURES`), the cores the process may use and torch's threads, and the
    oneDNN ISA cap when ``ONEDNN_MAX_CPU_ISA`` sets one. Read from ``/proc/cpuinfo`` (Linux;
    elsewhere the platform's processor name only); imports torch only if already imported."""
    import platform
    import sys

    model, flags = platform.processor() or platform.machine(), set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    have = [f for f in CPU_FEATURES if f in flags] or ["none of " + "/".join(CPU_FEATURES)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    line = f"CPU: {model}; {' '.join(have)}; {cores} cores"
    torch = sys.modules.get("torch")
    if torch is not None:
        line += f", torch {torch.__version__} on {torch.get_num_threads()} threads"
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        line += f", ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}"
    return line


KV8 = "kv8"  # a quantization mode's part that puts the KV cache in int8


def quantization_mode(mode: str) -> tuple[str, str]:
    """A ``bench quantization`` mode as ``(--quantization, --kv-cache-dtype)``: ``none``,
    ``int8`` or ``q4`` for the weights, ``kv8`` for an int8 KV cache, joined by ``+``
    (``int8+kv8``; ``kv8`` alone: bfloat16 weights, int8 KV cache).

    Raises:
        ValueError: another part, a part twice, or two weight modes.
    """
    parts = mode.split("+")
    weights = [p for p in parts if p in ("none", "int8", "q4")]
    if (
        len(set(parts)) != len(parts)
        or len(weights) > 1
        or any(p not in ("none", "int8", "q4", KV8) for p in parts)
    ):
        raise ValueError(f"a mode is int8, q4 or none, optionally +{KV8}, or {KV8}: {mode!r}")
    return (weights[0] if weights else "none"), ("int8" if KV8 in parts else "auto")
