"""``iterserve bench quantization``: each mode (``--quantization``, optionally with
``--kv-cache-dtype int8``: :func:`~iterserve.bench.common.quantization_mode`) against bfloat16
and against llama.cpp's ``llama-server`` on the same GGUF, side by side in one run.

1. Quality (:mod:`iterserve.bench.quality`): perplexity on the shipped text and greedy
   agreement with bfloat16, each quantized kernel forced at every batch size (the most a mode
   can cost; served, small prefill chunks may run bfloat16 or int8 instead).
2. Online: a fresh ``iterserve serve --quantization MODE`` per mode, then ``llama-server``
   (built by ``scripts/llama-server-build``, one slot per stream), each driven by
   ``bench serve``'s client, closed loop, at each ``--concurrency`` (the same prompts, every
   request generating exactly ``--output-len`` tokens): output tokens/s, TTFT and TPOT.
3. Offline: ``LLM.generate`` over the same prompts per mode, output tokens/s.

Every figure is printed with the CPU it ran on (:func:`~iterserve.bench.common.
cpu_capabilities`); the table, ``quantization.json`` and ``quantization.png`` are saved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from iterserve.bench.common import (
    cpu_capabilities,
    output_dir,
    quantization_mode,
    warn_if_loaded,
)
from iterserve.bench.fidelity_real import (
    client_args,
    free_port,
    real_server,
    server_process,
    warm_up,
)
from iterserve.bench.serve import run_load
from iterserve.workload.stats import SLO, summarize
from iterserve.workload.workloads import BenchRequest, corpus_text

LLAMA_SERVER_BUILD = Path(__file__).resolve().parents[2] / "scripts" / "llama-server-build"
FORCED_MAX_ROWS = {"int8": 1 << 30, "q4": 1 << 30}  # the quantized kernel at every batch size


def prompts(count: int, prompt_len: int, seed: int) -> list[str]:
    """``count`` distinct prompts of about ``prompt_len`` tokens (4 characters each) cut from
    Python's docstrings (:func:`~iterserve.workload.workloads.corpus_text`), seeded."""
    text = corpus_text()
    size = prompt_len * 4
    step = max(1, (len(text) - size) // max(count, 1))
    start = (seed * 7919) % step
    return [text[start + i * step : start + i * step + size] for i in range(count)]


def requests_for(texts: list[str], prompt_len: int, output_len: int) -> list[BenchRequest]:
    return [BenchRequest(prompt=t, prompt_len=prompt_len, output_len=output_len) for t in texts]


@contextmanager
def llama_server(binary: Path, gguf: Path, slots: int, slot_ctx: int, log: Path) -> Iterator[str]:
    """llama.cpp's server on ``gguf``, ``slots`` parallel slots of ``slot_ctx`` tokens
    (continuous batching), as many threads as this process may use; its URL, ready; stopped
    on exit.

    Raises:
        FidelityError: it exited or was not ready within 300 s.
    """
    port = free_port()
    threads = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(slots), "-c", str(slots * slot_ctx), "-t", threads, "-cb"]
    if "amx_int8" in cpu_capabilities():
        # ggml's AMX path (ggml_backend_amx_mul_mat, reached through weight repacking)
        # segfaults at the first forward on these VMs; without repacking llama.cpp runs its
        # AVX-512 VNNI kernels, its path on CPUs without AMX.
        cmd.append("--no-repack")
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url, "/health", log):
        yield url


def online_runs(
    url: str, model: str, concurrency: list[int], args: argparse.Namespace
) -> dict[int, dict[str, Any]]:
    """Closed-loop runs at each concurrency against ``url``: ``bench serve``'s summaries."""
    runs = {}
    for c in concurrency:
        count = max(args.min_requests, 2 * c)
        reqs = requests_for(prompts(count, args.prompt_len, args.seed), args.prompt_len,
                            args.output_len)  # fmt: skip
        client = client_args(args.seed, concurrency=c)  # ignore_eos: exactly output_len each
        records, wall, _ = asyncio.run(run_load(url, reqs, model, client, float("inf")))
        summary = summarize(records, wall, SLO())
        summary["errors"] = [r.error for r in records if r.error][:5]
        runs[c] = summary
        print(f"  c={c}: {summary['output_tokens_per_s']:.1f} output tok/s", flush=True)
    return runs


def iterserve_online(mode: str, args: argparse.Namespace, out: Path) -> dict[int, dict[str, Any]]:
    weights, kv_cache_dtype = quantization_mode(mode)
    flags = ["--quantization", weights, "--kv-cache-dtype", kv_cache_dtype]
    flags += ["--max-num-seqs", str(max(args.concurrency))]
    with real_server(0, flags, out / f"server-{mode}.log") as (url, _pid):
        return online_runs(url, warm_up(url), args.concurrency, args)


def logged_plan(log: Path) -> str | None:
    """The plan a server logged at start (``quantization <plan>``), or None."""
    for line in log.read_text(errors="replace").splitlines():
        if "iterserve.executor.quantization: quantization " in line:
            return line.split(": quantization ", 1)[1]
    return None


def llama_online(binary: Path, args: argparse.Namespace, out: Path) -> dict[int, dict[str, Any]]:
    from iterserve.models.loader import default_gguf_path

    slot_ctx = args.prompt_len * 2 + args.output_len + 64
    log = out / "llama-server.log"
    with llama_server(binary, default_gguf_path(), max(args.concurrency), slot_ctx, log) as url:
        body = {"prompt": "Hello", "max_tokens": 2}
        httpx.post(url + "/v1/completions", json=body, timeout=300).raise_for_status()
        return online_runs(url, "default", args.concurrency, args)


def offline_throughput(mode: str, args: argparse.Namespace) -> dict[str, float]:
    """``LLM.generate`` of ``--offline-requests`` prompts at once: output tokens/s."""
    from iterserve import LLM, SamplingParams

    texts = prompts(args.offline_requests, args.prompt_len, args.seed + 1)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True
    )
    weights, kv_cache_dtype = quantization_mode(mode)
    settings = {"quantization": weights, "kv_cache_dtype": kv_cache_dtype}
    with LLM(max_num_seqs=max(args.concurrency), **settings) as llm:
        llm.generate(texts[:2], SamplingParams(max_tokens=2))
        start = time.perf_counter()
        outs = llm.generate(texts, params)
        wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens_per_s": tokens / wall, "seconds": wall, "output_tokens": tokens}


def quality_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """:func:`~iterserve.bench.quality.measure_quality` of every mode, its kernel forced."""
    from iterserve.bench.quality import measure_quality

    texts = prompts(args.quality_prompts, 64, args.seed + 2)
    rows = measure_quality(args.modes, texts, args.quality_tokens, forced=FORCED_MAX_ROWS)
    return [asdict(row) for row in rows]


def find_llama_server(choice: str) -> Path | None:
    """``--llama-server``: a path, ``none``, or ``auto`` (build or find it with
    ``scripts/llama-server-build``; None, with a note, where that fails)."""
    if choice == "none":
        print("note: --llama-server none (--smoke sets it): no llama.cpp rows", flush=True)
        return None
    if choice != "auto":
        return Path(choice)
    if not LLAMA_SERVER_BUILD.exists():
        print(
            "note: scripts/llama-server-build not found (an installed package): no llama.cpp rows"
        )
        return None
    print("llama-server: scripts/llama-server-build (about 6 minutes the first time)", flush=True)
    built = subprocess.run(
        [str(LLAMA_SERVER_BUILD), sys.executable], capture_output=True, text=True, check=False
    )
    if built.returncode != 0:
        print(f"note: llama-server did not build, no llama.cpp rows:\n{built.stderr[-2000:]}")
        return None
    return Path(built.stdout.strip().splitlines()[-1])


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def _run(runs: dict[Any, Any], c: int) -> dict[str, Any] | None:
    """A run by concurrency, keyed by int (this run) or str (read back from JSON)."""
    return runs.get(c) or runs.get(str(c))


def format_tables(results: dict[str, Any]) -> str:
    """The quality, online and offline tables, ratios against bfloat16 and llama.cpp."""
    lines = [results["cpu"], ""]
    if results.get("quality"):
        lines.append("quality (each quantized kernel at every batch size): perplexity, and greedy")
        lines.append("agreement with bf16: whole continuation equal | share before the first")
        lines.append("difference | first token equal")
        lines.append(f"{'mode':9} {'perplexity':>10} {'whole':>6} {'share':>7} {'first':>6}")
        for q in results["quality"]:
            a = q["agreement"] or {"exact": 1.0, "prefix": 1.0, "first_token": 1.0}
            mode = "bf16" if q["mode"] == "none" else q["mode"]
            lines.append(
                f"{mode:9} {q['perplexity']:10.3f} {a['exact']:6.2f} {a['prefix']:7.2f} "
                f"{a['first_token']:6.2f}"
            )
        lines.append("")
    online, conc = results["online"], results["args"]["concurrency"]
    lines.append("online: output tok/s (vs bf16, vs llama.cpp) | TTFT p50 ms | TPOT p50 ms")
    for engine, runs in online.items():
        cells = []
        for c in conc:
            run = _run(runs, c)
            if run is None:
                continue
            tps = run["output_tokens_per_s"]
            bf16 = (_run(online.get("none", {}), c) or {}).get("output_tokens_per_s")
            llama = (_run(online.get("llama.cpp", {}), c) or {}).get("output_tokens_per_s")
            cells.append(
                f"c={c}: {tps:6.1f} ({_ratio(tps, bf16)}, {_ratio(tps, llama)}) | "
                f"{run['ttft_ms']['p50']:.0f} | {run['tpot_ms']['p50']:.1f}"
            )
        lines.append(f"{'bf16' if engine == 'none' else engine:9} " + "   ".join(cells))
    for mode, plan in results.get("plans", {}).items():
        lines.append(f"  plan of the {mode} server: {plan}")
    if results.get("offline"):
        bf16 = results["offline"]["none"]["output_tokens_per_s"]
        lines += ["", "offline: output tok/s (vs bf16)"]
        for mode, row in results["offline"].items():
            tps = row["output_tokens_per_s"]
            lines.append(f"{'bf16' if mode == 'none' else mode:9} {tps:8.1f} ({_ratio(tps, bf16)})")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Output tokens/s per engine at each concurrency (grouped bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = results["args"]["concurrency"]
    engines = list(results["online"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(engines))
    for i, engine in enumerate(engines):
        values = [(_run(results["online"][engine], c) or {}).get("output_tokens_per_s", 0.0)
                  for c in conc]  # fmt: skip
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(conc))]
        ax.bar(xs, values, width, label="bf16" if engine == "none" else engine)
    ax.set_xticks(range(len(conc)), [f"c={c}" for c in conc])
    ax.set_ylabel("output tokens/s")
    ax.set_title(results["cpu"][:100], fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ``--smoke``: int8 weights with an int8 KV cache beside bf16 at one stream, two short
# requests, no llama.cpp (~2 minutes).
SMOKE = {
    "modes": ["int8+kv8"],
    "concurrency": [1],
    "min_requests": 2,
    "prompt_len": 32,
    "output_len": 8,
    "offline_requests": 2,
    "quality_prompts": 2,
    "quality_tokens": 4,
    "llama_server": "none",
}


def main(args: argparse.Namespace) -> int:
    if args.smoke:  # a tiny run that checks the pipeline: overrides the sizing flags
        args = argparse.Namespace(**{**vars(args), **SMOKE})
    warn_if_loaded()
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    import torch  # noqa: F401  (the capability line then names torch's threads)

    settings = {k: v for k, v in vars(args).items() if k != "func"}
    results: dict[str, Any] = {"cpu": cpu_capabilities(), "args": settings}
    print(results["cpu"], flush=True)
    if not args.no_quality:
        results["quality"] = quality_rows(args)
    results["online"] = {}
    for mode in ["none", *args.modes]:
        weights, kv_cache_dtype = quantization_mode(mode)
        print(f"iterserve --quantization {weights} --kv-cache-dtype {kv_cache_dtype}", flush=True)
        results["online"][mode] = iterserve_online(mode, args, out)
        weights = quantization_mode(mode)[0]
        if weights != "none" and (plan := logged_plan(out / f"server-{mode}.log")):
            results.setdefault("plans", {})[mode] = plan
    binary = find_llama_server(args.llama_server)
    if binary is not None:
        print(f"llama.cpp {binary}", flush=True)
        results["online"]["llama.cpp"] = llama_online(binary, args, out)
    if not args.no_offline:
        results["offline"] = {m: offline_throughput(m, args) for m in ["none", *args.modes]}
    print(format_tables(results))
    (out / "quantization.json").write_text(json.dumps(results, indent=2, default=str))
    plot(results, out / "quantization.png")
    print(f"wrote {out / 'quantization.json'} and {out / 'quantization.png'}")
    return 0
