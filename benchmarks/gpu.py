"""``python -m benchmarks.gpu``: the prepared check of a lent GPU, in one run.

Run on the GPU machine from the repository root (nothing installed there but torch, triton and
transformers; no model files, no downloads)::

    PYTHONPATH=. python -m benchmarks.gpu --output-dir $OUT          # under 5 min, H200
    PYTHONPATH=. python -m benchmarks.gpu --quick --output-dir $OUT  # under 2 min

Sections, each on its own (one failing leaves the others' results; the exit status is 1 if
any failed):

1. ``kernel_checks``: the Triton kernel tests' cases on the device, bfloat16 included;
2. ``attention_bandwidth``: the paged-attention decode kernel's bandwidth vs a device copy;
3. ``offline_throughput``: iterserve vs transformers' continuous batching, Llama-3-8B shape;
4. ``decode_floor``: the decode iteration at batch 64 vs its weight-and-KV read floor;
5. ``engine_parity``: the engine's greedy tokens on the device vs on the CPU (float32).

Results go to ``gpu.json`` (``gpu-quick.json``) in ``--output-dir`` and a table on stdout.
``--device cpu`` with tiny shapes runs every section on a CPU (tests; Triton under its
interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

SECTIONS = {
    1: "kernel_checks",
    2: "attention_bandwidth",
    3: "offline_throughput",
    4: "decode_floor",
    5: "engine_parity",
}
# Run order: the small sections first; 4 before 3 (3 frees the shared 8B model).
RUN_ORDER = (1, 2, 5, 4, 3)
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


@dataclass(frozen=True)
class Plan:
    """What one run does: the flags resolved for ``--quick`` or the full run."""

    sections: tuple[int, ...]
    attention_shapes: tuple[tuple[int, int], ...]
    attention_geometry: tuple[int, int, int]  # heads, KV heads, head_dim
    llama: Any  # LlamaBenchSettings
    parity_requests: int
    parity_tokens: int
    copy_bytes: int
    enforce_eager: bool = False


def _ints(text: str, sep: str) -> list[int]:
    return [int(x) for x in text.split(sep)]


def make_plan(args: argparse.Namespace) -> Plan:
    """Resolve the flags left unset to the full run's values or ``--quick``'s."""
    import torch

    from benchmarks.gpu_llama8b import LlamaBenchSettings
    from benchmarks.gpu_models import LlamaShape

    quick = args.quick
    shapes = args.attention_shapes or (
        "64x2048,256x2048" if quick else "64x2048,64x8192,256x2048,256x8192"
    )
    hidden, layers, heads, kv_heads, inter, vocab = _ints(args.llama_shape, ":")
    if args.num_layers is not None:
        layers = args.num_layers
    elif quick:
        layers = min(layers, 8)

    def pick(value: Any, full: Any, fast: Any) -> Any:
        return value if value is not None else (fast if quick else full)

    copy_bytes = args.copy_mib << 20
    llama = LlamaBenchSettings(
        shape=LlamaShape(hidden, layers, heads, kv_heads, inter, vocab),
        dtype=getattr(torch, _DTYPES[args.dtype]),
        backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        num_requests=pick(args.num_requests, 128, 64),
        prompt_len=pick(args.prompt_len, 256, 128),
        output_len=pick(args.output_len, 128, 64),
        decode_batch=args.decode_batch,
        decode_context=pick(args.decode_context, 1024, 512),
        decode_steps=pick(args.decode_steps, 32, 16),
        hf_timeout_s=pick(args.hf_timeout_s, 90.0, 25.0),
        copy_bytes=copy_bytes,
    )
    heads_a, kv_a, head_dim = _ints(args.attention_geometry, ":")
    return Plan(
        sections=tuple(s for s in RUN_ORDER if s in _ints(args.sections, ",")),
        attention_shapes=tuple((b, c) for b, c in (_ints(s, "x") for s in shapes.split(","))),
        attention_geometry=(heads_a, kv_a, head_dim),
        llama=llama,
        parity_requests=args.parity_requests,
        parity_tokens=pick(args.parity_tokens, 24, 16),
        copy_bytes=copy_bytes,
        enforce_eager=args.enforce_eager,
    )


def run_section(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn``'s result as ``{"status": "ok", "result": ...}``, or its error and traceback
    (``"failed"``) with whatever results a failed check carried."""
    from benchmarks.gpu_kernels import SectionFailed

    start = time.perf_counter()
    entry: dict[str, Any]
    try:
        entry = {"status": "ok", "result": fn()}
    except Exception as e:  # a failed section is a result: the others still run
        entry = {"status": "failed", "error": repr(e), "traceback": traceback.format_exc()}
        if isinstance(e, SectionFailed):
            entry["result"] = e.result
        print(entry["traceback"], file=sys.stderr, flush=True)
    entry["seconds"] = time.perf_counter() - start
    return entry


def _section_functions(plan: Plan, device: Any) -> dict[int, Callable[[], dict[str, Any]]]:
    from benchmarks import gpu_kernels, gpu_llama8b, gpu_models

    heads, kv_heads, head_dim = plan.attention_geometry
    shapes = [
        gpu_kernels.AttentionShape(b, c, heads, kv_heads, head_dim, 16, plan.llama.dtype)
        for b, c in plan.attention_shapes
    ]
    shared = gpu_llama8b.SharedLlama(plan.llama, device)
    backend = plan.llama.backend
    return {
        1: lambda: gpu_kernels.run_kernel_checks(device),
        2: lambda: gpu_kernels.run_attention_timing(shapes, device, plan.copy_bytes),
        3: lambda: gpu_llama8b.run_offline(shared),
        4: lambda: gpu_llama8b.run_decode_floor(shared),
        5: lambda: gpu_models.run_engine_parity(
            device,
            backend,
            plan.parity_requests,
            plan.parity_tokens,
            enforce_eager=plan.enforce_eager,
        ),
    }


def environment(device: Any) -> dict[str, Any]:
    import torch
    import transformers
    import triton

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"device_name": props.name, "device_memory_gib": props.total_memory / 2**30}
    return info


def main(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu: error: no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    plan = make_plan(args)
    start = time.perf_counter()
    report: dict[str, Any] = {
        "quick": args.quick,
        "argv": sys.argv[1:],
        "enforce_eager": args.enforce_eager,
        "environment": environment(device),
        "sections": {},
        "wall_s": 0.0,
    }
    if args.quick and plan.llama.shape.num_layers < 32:
        report["note"] = (
            f"--quick: sections 3 and 4 use {plan.llama.shape.num_layers} of Llama-3-8B's 32 "
            f"layers and fewer, shorter requests"
        )
    from benchmarks.gpu_kernels import triton_preflight

    preflight = triton_preflight(device)
    report["triton_preflight"] = preflight
    print(f"triton preflight: {_preflight_line(preflight)}", flush=True)
    if not preflight["ok"] and plan.llama.backend == "auto":
        # Sections 1 and 2 fail on their own; 3-5 still measure the engine on plain torch.
        plan = replace(plan, llama=replace(plan.llama, backend="torch"))
        fallback = "Triton does not run here: sections 3-5 use --attention-backend torch"
        report["note"] = "; ".join(filter(None, (report.get("note"), fallback)))
    functions = _section_functions(plan, device)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / ("gpu-quick.json" if args.quick else "gpu.json")
    from benchmarks.gpu_report import format_report, format_section

    for number in plan.sections:
        name = SECTIONS[number]
        print(f"== section {number}: {name}", flush=True)
        entry = {"section": number, **run_section(functions[number])}
        report["sections"][name] = entry
        print("\n".join(format_section(name, entry)), flush=True)
        # Written after every section: a run stopped by a time limit keeps what it measured.
        report["wall_s"] = time.perf_counter() - start
        path.write_text(json.dumps(report, indent=2, default=str))
    print("\n" + format_report(report))
    print(f"wrote {path}")
    failed = [n for n, e in report["sections"].items() if e["status"] != "ok"]
    return 1 if failed else 0


def _preflight_line(preflight: dict[str, Any]) -> str:
    status = "ok" if preflight["ok"] else f"FAILED {preflight['error'][:200]}"
    return (
        f"{status} ({preflight['seconds']:.1f} s; C compiler {preflight['c_compiler']}, "
        f"Python.h {'found' if preflight['python_h'] else 'missing'})"
    )


def _exit(code: int) -> None:
    """Exit with ``code``; at once if a thread outlives the run (a transformers generation
    thread that did not stop would otherwise keep the process alive: the results are
    written by now)."""
    sys.stdout.flush()
    sys.stderr.flush()
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if any(t.is_alive() and not t.daemon for t in others):
        print("benchmarks.gpu: a thread still runs; exiting without it", file=sys.stderr)
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _parser() -> argparse.ArgumentParser:
    from benchmarks.cli_args import add_gpu_args

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_gpu_args(parser)
    return parser


if __name__ == "__main__":
    # Nothing is downloaded: no retries against an unreachable hub (the lent machine is
    # offline). Set here, not in main(), which tests call in their own process.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _exit(main(_parser().parse_args()))
