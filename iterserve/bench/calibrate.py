"""``iterserve bench calibrate``: measure the real engine and fit a latency profile.

The real engine (scheduler, block manager, detokenizer) runs on this machine's model runner,
wrapped in a proxy that times every ``execute_model`` (the forward) and notes the batch's
:class:`~iterserve.sim.profile.BatchShape`; the engine's whole ``step_deltas()`` call is
timed around it, and ``overhead = total - forward`` (scheduling, bookkeeping,
detokenization: what a virtual-time replay adds per iteration). Two grids of cells, each on
a fresh engine over the one loaded runner, prefix caching off (distinct random prompts, so no
KV is shared):

- decode cells, batch x context: ``batch`` prompts of ``context`` tokens, prefilled in
  chunks of :data:`DECODE_BUDGET` tokens (the early finishers decode alongside: mixed
  iterations), then the whole batch decodes :data:`DECODE_STEPS` times, then it drains one
  finisher at a time. A cell whose KV does not fit the default pool is skipped (said so).
- prefill cells, one per chunk size: one prompt of :data:`PREFILL_REACH` + chunk tokens fed
  a chunk per iteration (``max_num_batched_tokens`` = chunk), so chunks start at offsets
  0, chunk, 2 * chunk, ... up to the reach.

Every iteration is a point; a warm-up cell's are discarded.
:mod:`iterserve.bench.calibrate_output` fits and writes the profile JSON (``--out``, default
``<dir>/profile.json``), ``points.json`` (every point, its prediction, its split) and
``fit.png`` (predicted vs measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from pathlib import Path

from iterserve.bench.calibrate_output import (
    Measurement,
    Point,
    build_profile,
    plot,
    report,
    save_points,
)
from iterserve.bench.common import output_dir, warn_if_loaded
from iterserve.config import EngineConfig
from iterserve.engine.factory import build_engine
from iterserve.engine.messages import AddRequest
from iterserve.engine.outputs import ModelRunner, ModelRunnerOutput, SchedulerOutput
from iterserve.engine.sampling_params import SamplingParams
from iterserve.sim.profile import BatchShape

DECODE_STEPS = 16  # iterations in which a decode cell's whole batch decodes
DECODE_BUDGET = 512  # max_num_batched_tokens of the decode cells (their prefill chunks)
PREFILL_REACH = 2048  # the prefill cells' chunks start at offsets up to this (tokens)
SWAP_SPACE_GIB = 0.05  # host pool for timing KV swaps (all of it is copied out and back)
# --smoke: a tiny grid (the test's), well under a minute; 4 x 160 prompt tokens exceed one
# DECODE_BUDGET iteration, so that cell has mixed (decode + prefill) iterations too.
SMOKE_GRID = {"batch_sizes": "1,4", "contexts": "32,160", "chunk_sizes": "32"}
SMOKE_REACH = 64


class TimingRunner:
    """A ``ModelRunner`` proxy that times each ``execute_model`` call (wall seconds) and keeps
    the shape of the batch it ran."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.last: tuple[BatchShape, float] | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = self.runner.execute_model(scheduler_output)
        self.last = (BatchShape.of(scheduler_output), time.perf_counter() - start)
        return output


class Calibration:
    """The loaded model and the cells run on it; ``run_cell`` returns a cell's points."""

    def __init__(self, args: argparse.Namespace) -> None:
        from iterserve.executor.build import build  # torch

        # The KV pool the default budget gives; "recompute": build need not time preemption.
        config = EngineConfig.from_kwargs(
            model=args.model,
            dtype=args.dtype,
            swap_space=SWAP_SPACE_GIB,
            preemption_mode="recompute",
        )
        self.loaded = build(config)
        self.timer = TimingRunner(self.loaded.runner)
        self.rng = random.Random(args.seed)
        self.model = args.model
        self.dtype = args.dtype
        self.skipped: list[str] = []

    def swap_bytes_per_s(self, repeats: int = 5) -> float:
        """Bytes / second of copying KV blocks out and back in (the engine's swap path, every
        block of the host pool, ~50 MB each way), median of ``repeats``; run while the pool
        is idle."""
        import torch

        kv = self.loaded.driver.kv_cache
        pairs = [(i, i) for i in range(min(kv.num_host_blocks, kv.num_blocks))]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            kv.swap_out(pairs)
            kv.swap_in(pairs)
            if self.loaded.runner.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return 2 * len(pairs) * kv.block_size * kv.bytes_per_token / statistics.median(times)

    def decode_cell(self, batch: int, context: int, steps: int = DECODE_STEPS) -> list[Point]:
        """``batch`` prompts of ``context`` tokens; each decodes until the last one's prefill is
        done, then ``steps`` more (so the whole batch decodes together), then the batch drains
        one finisher at a time. Skipped (empty) when its KV does not fit the pool."""
        budget = max(DECODE_BUDGET, 2 * batch)
        num_prefill_iterations = -(-batch * context // (budget - batch))
        max_tokens = steps + num_prefill_iterations + 1
        block_size = self.loaded.config.cache.block_size
        blocks = batch * -(-(context + max_tokens) // block_size)
        if blocks > 0.98 * self.loaded.num_kv_blocks:  # the watermark keeps 1% free
            self.skipped.append(f"decode b{batch} c{context}: {blocks} KV blocks > pool")
            return []
        prompts = [self._prompt(context) for _ in range(batch)]
        return self.run_cell(f"decode b{batch} c{context}", prompts, max_tokens, batch, budget)

    def prefill_cell(self, chunk: int, reach: int = PREFILL_REACH) -> list[Point]:
        return self.run_cell(f"prefill p{chunk}", [self._prompt(reach + chunk)], 1, 1, chunk)

    def run_cell(
        self,
        cell: str,
        prompts: list[list[int]],
        max_tokens: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> list[Point]:
        """Run ``prompts`` to ``max_tokens`` each on a fresh engine (own scheduler and block
        manager, the shared runner); one point per iteration with tokens."""
        loaded = self.loaded
        config = EngineConfig.from_kwargs(
            model=self.model,
            dtype=self.dtype,
            max_model_len=loaded.config.model.max_model_len,
            enable_prefix_caching=False,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=max_num_batched_tokens,
        )
        # No host pool: a cell never swaps.
        info = dataclasses.replace(loaded.info, num_host_blocks=0, model_dir=None)
        engine = build_engine(config, self.timer, loaded.tokenizer, info)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            request_id = f"{cell}-{i}"
            engine.validate(prompt, params)
            priority = engine.resolve_priority(None)
            engine.add(AddRequest(request_id, prompt, params, priority, time.monotonic()))
        points: list[Point] = []
        while engine.has_unfinished_requests():
            self.timer.last = None
            start = time.perf_counter()
            engine.step_deltas()
            total = time.perf_counter() - start
            if self.timer.last is not None and self.timer.last[0].num_seqs > 0:
                points.append(Point(cell, self.timer.last[0], self.timer.last[1], total))
        loaded.runner.states.clear()
        return points

    def _prompt(self, num_tokens: int) -> list[int]:
        vocab = int(self.loaded.hf_config.vocab_size)
        return [self.rng.randrange(100, vocab) for _ in range(num_tokens)]  # past specials


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def measure(args: argparse.Namespace) -> Measurement:
    """Load the model, time swaps, warm up, and run every cell (prints progress)."""
    cal = Calibration(args)
    swap_bytes_per_s = cal.swap_bytes_per_s()
    cal.decode_cell(2, 64, steps=4)  # warm-up: discarded
    reach = SMOKE_REACH if args.smoke else PREFILL_REACH
    points: list[Point] = []
    cells = [(b, c) for b in _ints(args.batch_sizes) for c in _ints(args.contexts)]
    for batch, context in cells:
        start = time.perf_counter()
        new = cal.decode_cell(batch, context)
        print(f"  decode b{batch} c{context}: {len(new)} points, {_since(start)}", flush=True)
        points += new
    for chunk in _ints(args.chunk_sizes):
        start = time.perf_counter()
        new = cal.prefill_cell(chunk, reach)
        print(f"  prefill p{chunk}: {len(new)} points, {_since(start)}", flush=True)
        points += new
    grid = (
        f"decode cells batch {args.batch_sizes} x context {args.contexts} "
        f"({DECODE_STEPS} whole-batch decodes each), prefill cells chunk {args.chunk_sizes} "
        f"at offsets up to {reach}"
    )
    return Measurement(cal.loaded, args.model, points, swap_bytes_per_s, grid, cal.skipped)


def _since(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"


def main(args: argparse.Namespace) -> int:
    if args.smoke:
        for key, value in SMOKE_GRID.items():
            setattr(args, key, value)
    warn_if_loaded()
    start = time.perf_counter()
    measured = measure(args)
    name = args.name or (Path(args.out).stem if args.out is not None else None)
    profile, held_out, errors = build_profile(measured, name, args.seed)
    points = measured.points
    print(report(profile, points, held_out, errors))
    for skipped in measured.skipped:
        print(f"skipped {skipped}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    directory = args.output_dir or output_dir(args) / f"calibrate-{stamp}"
    directory.mkdir(parents=True, exist_ok=True)
    profile_path = Path(args.out) if args.out is not None else directory / "profile.json"
    profile_path.parent.mkdir(parents=True, exist_ok=True)
    profile_path.write_text(profile.to_json())
    save_points(profile, points, held_out, directory / "points.json")
    plot(profile, points, held_out, directory / "fit.png")
    print(f"{len(points)} points in {_since(start)}")
    print(f"wrote {profile_path}, {directory / 'points.json'} and {directory / 'fit.png'}")
    return 0
