"""The tensor-parallel group's collectives over a real gloo group of two processes."""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from iterserve.models.parallel import TPGroup


def _rank(rank: int, init_file: str, results: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        tp = TPGroup(rank, 2)
        mine = {"rank": rank, "segments": ((rank + 1, "int8"),)}
        results.put((rank, tp.from_driver(mine)))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_drivers_object(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = str(tmp_path / "rendezvous")
    procs = [ctx.Process(target=_rank, args=(r, init_file, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    driver = {"rank": 0, "segments": ((1, "int8"),)}
    assert got == {0: driver, 1: driver}


def test_one_rank_keeps_its_own_object() -> None:
    obj = object()
    assert TPGroup().from_driver(obj) is obj
