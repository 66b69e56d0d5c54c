"""Decode-iteration micro-benchmark (:mod:`iterserve.bench.roofline`) alone: a table, JSON
and a PNG bar chart of iteration vs linears vs memory floor per (batch, context).

Run from the repository root: ``python -m benchmarks.decode [--smoke] [--shapes 32x128,...]``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from iterserve.bench.common import output_dir, warn_if_loaded
from iterserve.bench.roofline import DecodeRow, format_table, run_decode_bench


def save(rows: list[DecodeRow], meta: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "decode.json"
    data = {
        "meta": meta,
        "rows": [asdict(r) | {"vs_linears": r.vs_linears, "vs_floor": r.vs_floor} for r in rows],
    }
    json_path.write_text(json.dumps(data, indent=2))
    labels = [f"b{r.batch}/ctx{r.context}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    ax.bar([x - width for x in xs], [r.iteration_ms for r in rows], width, label="iteration")
    ax.bar(list(xs), [r.linears_ms for r in rows], width, label="linears alone")
    ax.bar([x + width for x in xs], [r.floor_ms for r in rows], width, label="memory floor")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ms per decode iteration")
    ax.set_title(
        f"Decode iteration, {meta['dtype']}, quantization {meta['quantization']}, "
        f"{meta['threads']} threads"
    )
    ax.legend()
    fig.tight_layout()
    png_path = out_dir / "decode.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path


def main(args: argparse.Namespace) -> int:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    iters = args.iters
    copy_bytes = 256 << 20
    if args.smoke:  # the bandwidth of a small copy: the smoke checks the pipeline only
        shapes, iters, copy_bytes = [(1, 16), (4, 32)], 2, 16 << 20
    warn_if_loaded()
    pairs = [(b, c) for b, c in shapes]
    rows, meta = run_decode_bench(
        pairs, args.dtype, iters, args.model, copy_bytes, args.quantization
    )
    print(meta["cpu"])
    bandwidth = meta["copy_bandwidth_gb_s"]
    print(f"quantization {args.quantization}; copy bandwidth {bandwidth:.1f} GB/s (read + write)")
    print(format_table(rows))
    json_path, png_path = save(rows, meta, output_dir(args))
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    from benchmarks.cli_args import parse_args

    raise SystemExit(main(parse_args("decode")))
