"""``iterserve bench offline``: one workload, five engines, one table of ratios, one run.

Rows (all on the same token ids of the seeded ``mixed`` workload, all arriving at once,
greedy, each request's output length enforced; bfloat16 by default):

1. iterserve, continuous batching + chunked prefill (the defaults);
2. iterserve, ``--no-enable-chunked-prefill``;
3. iterserve, ``--batching static``;
4. Hugging Face ``generate`` in static batches of ``max_num_seqs`` requests in arrival order,
   each batch run to its longest member (the naive server);
5. Hugging Face continuous batching (``generate_batch``'s manager, one ``max_new_tokens`` per
   request).

Each row reports useful output tokens per second (a request's own output tokens; padding and
tokens past a request's length in row 4 do not count) and its ratio to row 4. A roofline
table follows: the memory floor of one decode iteration (weight bytes + KV bytes read, over
the bandwidth of a copy measured in the same run) against the measured iteration time at
batch 32/64/128 with 512-token contexts (:mod:`iterserve.bench.roofline`).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from iterserve.workload.workloads import make_workload

ROW_NAMES = {
    1: "iterserve continuous + chunked prefill",
    2: "iterserve --no-enable-chunked-prefill",
    3: "iterserve --batching static",
    4: "HF generate, static batches",
    5: "HF continuous batching",
}
# Targets (row, baseline row, minimum ratio of output tokens/s; docs/benchmarks.md, "Offline").
TARGETS = [(1, 3, 2.5), (1, 4, 10.0), (1, 5, 5.0)]


@dataclass
class OfflineRow:
    row: int
    name: str
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _iterserve_row(
    row: int,
    prompts: list[list[int]],
    outputs: list[int],
    dtype: str,
    max_num_seqs: int,
    max_model_len: int,
) -> OfflineRow:
    from iterserve.engine.sampling_params import SamplingParams
    from iterserve.llm import LLM

    kwargs: dict[str, Any] = {"dtype": dtype, "max_num_seqs": max_num_seqs}
    kwargs["max_model_len"] = max_model_len
    if row == 2:
        kwargs |= {"enable_chunked_prefill": False, "max_num_batched_tokens": max_model_len}
    if row == 3:
        kwargs["batching"] = "static"
    llm = LLM(**kwargs)
    params = [
        SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        for n in outputs
    ]
    requests: list[Any] = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:2], params[:2])  # warm-up
    start = time.perf_counter()
    outs = llm.generate(requests, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs), "every request must produce its output length"
    del llm
    gc.collect()
    return OfflineRow(row, ROW_NAMES[row], produced, seconds)


def _hf_model(dtype: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from iterserve.models.loader import resolve_model_dir

    model_dir = resolve_model_dir("default")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16}.get(dtype, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _hf_static_row(
    prompts: list[list[int]], outputs: list[int], dtype: str, batch_size: int
) -> OfflineRow:
    import torch

    model, tokenizer = _hf_model(dtype)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=False,
                pad_token_id=pad,
            )
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    return OfflineRow(4, ROW_NAMES[4], sum(outputs), seconds)


def _hf_cache_for(prompts: list[list[int]], outputs: list[int]) -> Any:
    """A continuous-batching config whose KV cache holds the whole workload at once (each
    request's prompt and output in whole pages). Without one, transformers sizes the cache
    from the free memory: on a CPU host that is a cache of many GiB that every step walks
    (50 s for the smoke's 8 short requests, 7 s with this)."""
    from transformers import ContinuousBatchingConfig

    page_size = ContinuousBatchingConfig().page_size  # tokens per page
    num_blocks = sum(-(-(len(p) + n) // page_size) for p, n in zip(prompts, outputs, strict=True))
    return ContinuousBatchingConfig(num_blocks=num_blocks)


def _hf_continuous_row(
    prompts: list[list[int]], outputs: list[int], dtype: str, cache_config: Any = None
) -> OfflineRow:
    """Row 5. ``cache_config``: a ``ContinuousBatchingConfig`` (None: transformers sizes the
    cache itself)."""
    from transformers import GenerationConfig

    model, tokenizer = _hf_model(dtype)
    config = GenerationConfig(
        max_new_tokens=max(outputs), do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    produced = 0
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, continuous_batching_config=cache_config
    ) as cb:
        ids = [
            cb.add_request(p, max_new_tokens=n, eos_token_id=-1)  # -1: never stop early
            for p, n in zip(prompts, outputs, strict=True)
        ]
        done: set[str] = set()
        while len(done) < len(ids):
            result = cb.get_result(timeout=1)
            if result is not None and result.is_finished():
                done.add(result.request_id)
                produced += len(result.generated_tokens)
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    return OfflineRow(5, ROW_NAMES[5], produced, seconds)


def format_table(rows: list[OfflineRow]) -> str:
    base = next((r for r in rows if r.row == 4), None)
    lines = [f"{'#':>2} {'engine':<40} {'out tokens':>10} {'seconds':>8} {'tok/s':>8} {'vs 4':>6}"]
    for r in rows:
        ratio = f"{r.tokens_per_s / base.tokens_per_s:5.1f}x" if base else "     -"
        lines.append(
            f"{r.row:>2} {r.name:<40} {r.output_tokens:>10} {r.seconds:8.1f} "
            f"{r.tokens_per_s:8.1f} {ratio}"
        )
    return "\n".join(lines)


def format_targets(rows: list[OfflineRow]) -> str:
    by_row = {r.row: r for r in rows}
    lines = []
    for a, b, target in TARGETS:
        if a in by_row and b in by_row:
            ratio = by_row[a].tokens_per_s / by_row[b].tokens_per_s
            verdict = "met" if ratio >= target else f"missed by {target / ratio:.2f}x"
            lines.append(f"target row {a} >= {target:g}x row {b}: {ratio:.2f}x ({verdict})")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from iterserve.bench.common import cpu_capabilities, warn_if_loaded
    from iterserve.bench.roofline import format_table as roofline_table
    from iterserve.bench.roofline import run_decode_bench
    from iterserve.bench.serve import _tokenizer

    warn_if_loaded()
    import torch  # noqa: F401  (the capability line then names torch's threads)

    cpu = cpu_capabilities()
    print(cpu)
    num_requests, max_output = (8, 16) if args.smoke else (args.num_requests, 512)
    tokenizer = _tokenizer("default")
    workload = make_workload("mixed", tokenizer, num_requests, args.seed, max_output)
    prompts = [list(tokenizer(r.prompt).input_ids) for r in workload]
    outputs = [r.output_len for r in workload]
    max_model_len = max(len(p) + n for p, n in zip(prompts, outputs, strict=True))
    max_model_len = -(-max_model_len // 256) * 256
    print(
        f"mixed workload: {num_requests} requests, {sum(map(len, prompts))} prompt tokens, "
        f"{sum(outputs)} output tokens, {args.dtype}, max_num_seqs {args.max_num_seqs}"
    )
    rows: list[OfflineRow] = []
    for row in sorted(int(x) for x in args.rows.split(",")):
        if row in (1, 2, 3):
            result = _iterserve_row(
                row, prompts, outputs, args.dtype, args.max_num_seqs, max_model_len
            )
        elif row == 4:
            result = _hf_static_row(prompts, outputs, args.dtype, args.max_num_seqs)
        elif row == 5:
            # The smoke sizes HF's cache to the workload (its own sizing takes most of the
            # time of a few short requests on a CPU); the full run keeps transformers' sizing,
            # as docs/benchmarks.md's figures were measured.
            cache_config = _hf_cache_for(prompts, outputs) if args.smoke else None
            result = _hf_continuous_row(prompts, outputs, args.dtype, cache_config)
        else:
            raise SystemExit(f"no row {row}; rows are 1-5")
        rows.append(result)
        print(f"row {row} ({result.name}): {result.tokens_per_s:.1f} output tokens/s", flush=True)
    print(format_table(rows))
    print(format_targets(rows))
    roofline: list[Any] = []
    meta: dict[str, Any] = {}
    if not args.no_roofline:
        shapes = [(1, 16), (4, 32)] if args.smoke else [(32, 512), (64, 512), (128, 512)]
        iters, copy_bytes = (2, 16 << 20) if args.smoke else (5, 256 << 20)
        roofline, meta = run_decode_bench(shapes, args.dtype, iters, copy_bytes=copy_bytes)
        print(f"roofline (copy bandwidth {meta['copy_bandwidth_gb_s']:.1f} GB/s):")
        print(roofline_table(roofline))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.output_dir / ("offline-smoke.json" if args.smoke else "offline.json")
    json_path.write_text(
        json.dumps(
            {
                "cpu": cpu,
                "num_requests": num_requests,
                "dtype": args.dtype,
                "max_num_seqs": args.max_num_seqs,
                "rows": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in rows],
                "targets": format_targets(rows).splitlines(),
                "roofline": [
                    {**asdict(r), "vs_floor": r.vs_floor, "vs_linears": r.vs_linears}
                    for r in roofline
                ],
                "roofline_meta": meta,
            },
            indent=2,
        )
    )
    png = _plot(rows, json_path.with_suffix(".png"))
    print(f"wrote {json_path} and {png}")
    return 0


def _plot(rows: list[OfflineRow], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh([f"{r.row}. {r.name}" for r in rows], [r.tokens_per_s for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("output tokens/s")
    ax.set_title("offline throughput, mixed workload")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
