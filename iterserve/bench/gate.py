"""``iterserve bench gate``: the deploy gate for scheduler changes.

Compares a candidate ``bench serve`` result with a baseline result (same workload, same
load) and exits 1 when p99 TTFT grew by more than ``--max-ttft-p99-regression`` (default
20%) or p50 TPOT by more than ``--max-tpot-p50-regression`` (default 15%).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from iterserve.workload.stats import gate


def _summary(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    summary = data.get("summary", data)
    if "ttft_ms" not in summary or "tpot_ms" not in summary:
        raise SystemExit(f"{path}: not a `bench serve` result (no ttft_ms/tpot_ms)")
    return summary


def main(args: argparse.Namespace) -> int:
    results = gate(
        _summary(args.baseline),
        _summary(args.candidate),
        args.max_ttft_p99_regression,
        args.max_tpot_p50_regression,
    )
    print(f"{'metric':>12} {'baseline':>10} {'candidate':>10} {'change':>8} {'limit':>7}  verdict")
    for r in results:
        verdict = "ok" if r.passed else "REGRESSED"
        print(
            f"{r.metric:>12} {r.baseline:10.1f} {r.candidate:10.1f} {r.change:+8.1%} "
            f"{r.limit:+7.0%}  {verdict}"
        )
    failed = [r.metric for r in results if not r.passed]
    print("gate: " + (f"FAILED ({', '.join(failed)})" if failed else "passed"))
    return 1 if failed else 0
