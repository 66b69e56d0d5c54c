"""``iterserve bench calibrate``: measure the real engine and fit a latency profile.

The real engine (scheduler, block manager, detokenizer) runs on this machine's model runner,
built as ``iterserve serve``'s engine process builds it (:func:`iterserve.executor.build.build`:
the same platform, kernels, weight packing, dtype and torch threads), wrapped in a proxy that
times every ``execute_model`` (the forward) and notes the batch's
:class:`~iterserve.sim.profile.BatchShape`; the engine's whole ``step_deltas()`` call is
timed around it, and ``overhead = total - forward`` (scheduling, bookkeeping,
detokenization: what a virtual-time replay adds per iteration). Two grids of cells, each run
on a fresh engine over the one loaded runner, prefix caching off (distinct random prompts, so
no KV is shared):

- decode cells, batch x context: ``batch`` prompts of ``context`` tokens, prefilled in
  chunks of :data:`DECODE_BUDGET` tokens (the early finishers decode alongside: mixed
  iterations), then the whole batch decodes :data:`DECODE_STEPS` times, then it drains one
  finisher at a time. A cell whose KV does not fit the default pool is skipped (said so).
- prefill cells, one per chunk size: one prompt of :data:`PREFILL_REACH` + chunk tokens fed
  a chunk per iteration (``max_num_batched_tokens`` = chunk), so chunks start at offsets
  0, chunk, 2 * chunk, ... up to the reach.
- arrival cells, one per prompt length: :data:`ARRIVAL_PROMPTS` prompts of that length added
  one per iteration, each decoding :data:`ARRIVAL_OUTPUT` tokens: every iteration prefills
  one fresh prompt beside a growing batch of decodes, the iteration a server runs when a
  request arrives while others stream (which the other cells, batches prefilled together
  or one long prompt, never run).

Measuring what it thinks it measures (docs/simulator.md, "Calibrating a profile"):

- **Warm-up per shape.** Each cell first runs once with the same prompts (a decode cell with
  :data:`WARMUP_DECODE_STEPS` whole-batch decodes: every token count of the cell, prefill
  chunks and drain included), discarded: oneDNN creates (JIT-compiles) a primitive per matmul
  shape on its first use, and the allocator and caches settle; a single warm-up cell at the
  start left every later cell's first iterations cold.
- **Repeats.** Then the cell runs ``--repeats`` times with the same prompts; the scheduler is
  deterministic, so every shape is measured ``repeats`` times.
- **Outliers and noise.** Per shape, repeats beyond median +- 3 scaled MADs are rejected, and
  the repeats' spread is the machine's noise (:func:`iterserve.sim.fit.reject_outliers`).
- **Cells that do not fit.** After the fit, a cell whose median error exceeds the bound is
  measured again, once (warm-up and repeats), and the fit redone. A cell still over it is
  dropped when its own repeats spread by more than half the bound (the machine was too noisy
  to measure it), kept otherwise (the model cannot fit it: the held-out check judges it); a
  note in the profile says which.
- **The bound.** A profile whose held-out median error exceeds ``--max-held-out-error-pct``,
  or any cell's error twice that, is refused: not written, exit code 1, the reasons printed
  (cells, errors, noise); ``--force`` writes it with the reasons as a warning in its notes.
  ``points.json`` and ``fit.png`` are written either way.

:mod:`iterserve.bench.calibrate_output` fits and writes; :func:`calibrate` is the in-process
entry point (a :class:`Calibrated`: the profile or the refusal), :func:`main` the command's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from iterserve.bench.calibrate_output import (
    Fit,
    Measurement,
    Point,
    fit_profile,
    plot,
    refusal,
    report,
    save_points,
)
from iterserve.bench.common import output_dir, warn_if_loaded
from iterserve.config import DEFAULT_MODEL_NAME, EngineConfig
from iterserve.engine.factory import build_engine
from iterserve.engine.messages import AddRequest
from iterserve.engine.outputs import ModelRunner, ModelRunnerOutput, SchedulerOutput
from iterserve.engine.sampling_params import SamplingParams
from iterserve.sim.profile import (
    BatchShape,
    EngineOverhead,
    IterationModel,
    KVCacheSpec,
    LatencyProfile,
    ModelSpec,
    ProfileSource,
    SwapSpec,
)

DECODE_STEPS = 8  # iterations in which a decode cell's whole batch decodes (per repeat)
WARMUP_DECODE_STEPS = 2  # the same in a decode cell's warm-up run
DECODE_BUDGET = 512  # max_num_batched_tokens of the decode cells (their prefill chunks)
PREFILL_REACH = 2048  # the prefill cells' chunks start at offsets up to this (tokens)
SWAP_SPACE_GIB = 0.05  # host pool for timing KV swaps (all of it is copied out and back)
# --smoke: a tiny grid (the test's), well under a minute; 4 x 160 prompt tokens exceed one
# DECODE_BUDGET iteration, so that cell has mixed (decode + prefill) iterations too.
SMOKE_GRID = {
    "batch_sizes": "1,4",
    "contexts": "32,160",
    "chunk_sizes": "32",
    "arrival_lengths": "48",
}
SERVE_CHECK_FACTOR = 2  # the serve stage's check may miss by this x the bound (TTFT: twice)
ARRIVAL_PROMPTS = 8  # prompts of an arrival cell, added one per iteration
ARRIVAL_OUTPUT = 10  # tokens each of them decodes
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


@dataclass
class Cell:
    """One cell of the grid: its prompts, how far each runs (measured and warm-up runs), and
    the engine limits it runs under."""

    name: str
    prompts: list[list[int]]
    max_tokens: int
    warmup_max_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    arrival_gap: int = 0  # add a prompt every this many iterations (0: all at the start)


class Calibration:
    """The loaded model and the cells run on it; :meth:`measure_cell` returns a cell's points."""

    def __init__(self, args: argparse.Namespace) -> None:
        from iterserve.executor.build import build  # torch

        # The KV pool the default budget gives; "recompute": build need not time preemption.
        # Everything else (platform, kernels, weight packing, threads) is what `serve` builds.
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
        self.repeats = args.repeats
        self.cells: dict[str, Cell] = {}
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

    def base_profile(self, swap_bytes_per_s: float) -> LatencyProfile:
        """The profile's model side (spec, KV pool, swap, hardware); the fit fills the rest."""
        loaded, hf = self.loaded, self.loaded.hf_config
        dtype = str(loaded.driver.model.embed_tokens.weight.dtype).removeprefix("torch.")
        model_name = DEFAULT_MODEL_NAME if self.model == "default" else loaded.model_dir.name
        device = loaded.runner.device.type
        assert loaded.config.model.max_model_len is not None  # build() resolves it
        return LatencyProfile(
            name=f"{device}-{model_name.lower()}",
            model=ModelSpec(
                name=model_name,
                max_model_len=loaded.config.model.max_model_len,
                vocab_size=int(hf.vocab_size),
                eos_token_ids=sorted(loaded.eos_token_ids),
                num_layers=int(hf.num_hidden_layers),
                dtype=dtype,
            ),
            iteration=IterationModel(
                fixed_s=0,
                per_decode_token_s=0,
                per_prefill_token_s=0,
                per_context_token_s=0,
                per_attention_pair_s=0,
            ),
            engine_overhead=EngineOverhead(),
            kv_cache=KVCacheSpec(
                block_size=loaded.config.cache.block_size,
                num_blocks=loaded.num_kv_blocks,
                kv_bytes_per_token=loaded.driver.kv_cache.bytes_per_token,
            ),
            swap=SwapSpec(bytes_per_s=swap_bytes_per_s),
            source=ProfileSource(hardware=_hardware(device), date="", method=""),
        )

    def decode_cell(self, batch: int, context: int, steps: int = DECODE_STEPS) -> Cell | None:
        """``batch`` prompts of ``context`` tokens; each decodes until the last one's prefill is
        done, then ``steps`` more (so the whole batch decodes together), then the batch drains
        one finisher at a time. None (and noted as skipped) when its KV does not fit the
        pool."""
        budget = max(DECODE_BUDGET, 2 * batch)
        num_prefill_iterations = -(-batch * context // (budget - batch))
        max_tokens = steps + num_prefill_iterations + 1
        block_size = self.loaded.config.cache.block_size
        blocks = batch * -(-(context + max_tokens) // block_size)
        name = f"decode b{batch} c{context}"
        if blocks > 0.98 * self.loaded.num_kv_blocks:  # the watermark keeps 1% free
            self.skipped.append(f"{name}: {blocks} KV blocks > pool")
            return None
        prompts = [self._prompt(context) for _ in range(batch)]
        warmup = min(max_tokens, WARMUP_DECODE_STEPS + num_prefill_iterations + 1)
        return Cell(name, prompts, max_tokens, warmup, batch, budget)

    def prefill_cell(self, chunk: int, reach: int = PREFILL_REACH) -> Cell:
        return Cell(f"prefill p{chunk}", [self._prompt(reach + chunk)], 1, 1, 1, chunk)

    def arrival_cell(self, length: int) -> Cell:
        """:data:`ARRIVAL_PROMPTS` prompts of ``length`` tokens, one added per iteration."""
        prompts = [self._prompt(length) for _ in range(ARRIVAL_PROMPTS)]
        budget = max(DECODE_BUDGET, ARRIVAL_PROMPTS)
        return Cell(
            f"arrival l{length}", prompts, ARRIVAL_OUTPUT, ARRIVAL_OUTPUT, ARRIVAL_PROMPTS,
            budget, arrival_gap=1,
        )  # fmt: skip

    def measure_cell(self, cell: Cell) -> list[Point]:
        """A warm-up run of ``cell`` (discarded), then :attr:`repeats` measured runs."""
        self.cells[cell.name] = cell
        self.run(cell, cell.warmup_max_tokens, repeat=-1)
        return [p for r in range(self.repeats) for p in self.run(cell, cell.max_tokens, r)]

    def remeasure(self, name: str) -> list[Point]:
        """Measure the cell called ``name`` again (warm-up and repeats)."""
        return self.measure_cell(self.cells[name])

    def run(self, cell: Cell, max_tokens: int, repeat: int) -> list[Point]:
        """Run the cell's prompts to ``max_tokens`` each on a fresh engine (own scheduler and
        block manager, the shared runner); one point per iteration with tokens."""
        loaded = self.loaded
        config = EngineConfig.from_kwargs(
            model=self.model,
            dtype=self.dtype,
            max_model_len=loaded.config.model.max_model_len,
            enable_prefix_caching=False,
            max_num_seqs=cell.max_num_seqs,
            max_num_batched_tokens=cell.max_num_batched_tokens,
            long_prefill_token_threshold=cell.max_num_batched_tokens,
        )
        # No host pool: a cell never swaps.
        info = dataclasses.replace(loaded.info, num_host_blocks=0, model_dir=None)
        engine = build_engine(config, self.timer, loaded.tokenizer, info)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        pending = list(enumerate(cell.prompts))
        points: list[Point] = []
        num_steps = 0
        while pending or engine.has_unfinished_requests():
            if cell.arrival_gap == 0 or num_steps % cell.arrival_gap == 0:
                for i, prompt in pending[: 1 if cell.arrival_gap else len(pending)]:
                    request_id = f"{cell.name}-{repeat}-{i}"
                    engine.validate(prompt, params)
                    priority = engine.resolve_priority(None)
                    engine.add(AddRequest(request_id, prompt, params, priority, time.monotonic()))
                pending = pending[1:] if cell.arrival_gap else []
            num_steps += 1
            self.timer.last = None
            start = time.perf_counter()
            engine.step_deltas()
            total = time.perf_counter() - start
            if self.timer.last is not None and self.timer.last[0].num_seqs > 0:
                shape, forward = self.timer.last
                points.append(Point(cell.name, shape, forward, total, repeat))
        loaded.runner.states.clear()
        return points

    def _prompt(self, num_tokens: int) -> list[int]:
        vocab = int(self.loaded.hf_config.vocab_size)
        return [self.rng.randrange(100, vocab) for _ in range(num_tokens)]  # past specials


def _hardware(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def measure(args: argparse.Namespace) -> Measurement:
    """Load the model, time swaps, and run every cell (warm-up and repeats; prints progress)."""
    cal = Calibration(args)
    swap_bytes_per_s = cal.swap_bytes_per_s()
    reach = SMOKE_REACH if args.smoke else PREFILL_REACH
    cells = [cal.decode_cell(b, c) for b in _ints(args.batch_sizes) for c in _ints(args.contexts)]
    cells += [cal.prefill_cell(chunk, reach) for chunk in _ints(args.chunk_sizes)]
    cells += [cal.arrival_cell(length) for length in _ints(args.arrival_lengths)]
    points: list[Point] = []
    for cell in cells:
        if cell is None:
            continue
        start = time.perf_counter()
        new = cal.measure_cell(cell)
        print(f"  {cell.name}: {len(new)} points, {_since(start)}", flush=True)
        points += new
    grid = (
        f"decode cells batch {args.batch_sizes} x context {args.contexts} "
        f"({DECODE_STEPS} whole-batch decodes each), prefill cells chunk {args.chunk_sizes} "
        f"at offsets up to {reach}, arrival cells prompt {args.arrival_lengths} "
        f"({ARRIVAL_PROMPTS} prompts added one per iteration)"
    )
    return Measurement(
        cal.base_profile(swap_bytes_per_s), points, grid, args.repeats, cal.skipped, cal.remeasure
    )


def _since(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"


@dataclass
class Calibrated:
    """What :func:`calibrate` produced.

    Attributes:
        fit: the last fit (its ``profile`` is the profile, written or not).
        refused: why the profile does not meet the bound (empty: it does).
        profile_path: where the profile was written; None when refused without ``--force``.
        directory: where ``points.json`` and ``fit.png`` were written (always).
        notes: what was re-measured, dropped or kept (also in the profile's notes).
    """

    fit: Fit
    refused: list[str]
    profile_path: Path | None
    directory: Path
    notes: list[str] = field(default_factory=list)

    @property
    def profile(self) -> LatencyProfile:
        return self.fit.profile


def refit_bad_cells(
    m: Measurement, name: str, seed: int, bound_pct: float
) -> tuple[Fit, list[str]]:
    """Fit ``m``; cells whose median error exceeds ``bound_pct`` are re-measured once (when
    ``m.remeasure`` can) and the fit redone; a cell still over it is dropped when its repeats
    spread more than ``bound_pct / 2`` (too noisy to measure), kept otherwise (the model's
    limit); then the final fit. Returns it and the notes saying what was done (``m.points``
    is updated in place).

    Raises:
        ValueError: too few shapes to fit and hold some out.
    """
    notes: list[str] = []
    fit = fit_profile(m, name, seed)
    bad = [c for c in fit.cells if c.median_pct > bound_pct]
    if not bad:
        return fit, notes
    if m.remeasure is not None:
        for c in bad:
            print(f"  re-measuring {c.cell}: error {c.median_pct:.1f}% > {bound_pct:g}%")
            new = m.remeasure(c.cell)
            m.dropped += [p for p in m.points if p.cell == c.cell]
            m.points = [p for p in m.points if p.cell != c.cell] + new
        notes.append(
            f"re-measured once (error > {bound_pct:g}%): " + ", ".join(c.cell for c in bad)
        )
        fit = fit_profile(m, name, seed, notes)
    still = [c for c in fit.cells if c.median_pct > bound_pct]
    noisy = [c for c in still if c.noise_pct > bound_pct / 2]
    why_kept = "the model's limit, not the machine's noise"
    if noisy and len(noisy) == len(fit.cells):
        notes.append("every cell is over the bound and noisy: none dropped")
        noisy, why_kept = [], "too noisy to tell: the machine was busy"
    notes += [
        f"dropped cell {c.cell}: error {c.median_pct:.1f}%, its repeats spread "
        f"{c.noise_pct:.1f}% (> {bound_pct / 2:g}%: too noisy to measure)"
        for c in noisy
    ]
    notes += [
        f"kept cell {c.cell}: error {c.median_pct:.1f}% with its repeats within "
        f"{c.noise_pct:.1f}% ({why_kept})"
        for c in still
        if c not in noisy
    ]
    dropped = {c.cell for c in noisy}
    m.dropped += [p for p in m.points if p.cell in dropped]
    m.points = [p for p in m.points if p.cell not in dropped]
    m.skipped += [f"{cell}: dropped (too noisy)" for cell in sorted(dropped)]
    return fit_profile(m, name, seed, notes), notes


def calibrate(args: argparse.Namespace, measured: Measurement | None = None) -> Calibrated:
    """Measure (unless ``measured`` is given), fit, check the bound, write the files.

    The in-process entry point (``bench fidelity`` may call it): ``args`` as parsed by
    ``iterserve bench calibrate`` (``build_parser().parse_args(["bench", "calibrate", ...])``).
    The profile is written to ``--out`` (default ``<dir>/profile.json``) unless refused
    without ``--force``; ``points.json`` and ``fit.png`` always.

    Raises:
        ValueError: too few shapes to fit (a grid of one tiny cell).
    """
    if args.smoke:
        for key, value in SMOKE_GRID.items():
            setattr(args, key, value)
    warn_if_loaded()
    start = time.perf_counter()
    m = measured if measured is not None else measure(args)
    bound = args.max_held_out_error_pct
    name = args.name or (Path(args.out).stem if args.out is not None else m.base.name)
    fit, notes = refit_bad_cells(m, name, args.seed, bound)
    refused = refusal(fit, bound) + _too_few_kept(m, fit)
    print(report(fit))
    for skipped in m.skipped:
        print(f"skipped {skipped}")
    for note in notes:
        print(note)
    directory = args.output_dir or output_dir(args) / f"calibrate-{time.strftime('%Y%m%d-%H%M%S')}"
    directory.mkdir(parents=True, exist_ok=True)
    save_points(fit, directory / "points.json", refused, m.dropped)
    plot(fit, directory / "fit.png")
    print(
        f"{len(m.points)} points fitted ({len(m.dropped)} not: dropped or re-measured) in "
        f"{_since(start)}; wrote {directory / 'points.json'}, {directory / 'fit.png'}"
    )
    if not args.no_serve and not (refused and not args.force):
        refused += _serve_stage(args, fit, notes, directory)
    load = f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    if refused and not args.force:
        print(
            f"profile refused, not written (--force writes it anyway); {load}:\n  "
            + "\n  ".join(refused),
            file=sys.stderr,
        )
        return Calibrated(fit, refused, None, directory, notes)
    if refused:
        warning = "WARNING: written with --force although refused: " + "; ".join(refused)
        print(warning, file=sys.stderr)
        source = fit.profile.source
        fit.profile = fit.profile.model_copy(
            update={"source": source.model_copy(update={"notes": [warning, *source.notes]})}
        )
    profile_path = Path(args.out) if args.out is not None else directory / "profile.json"
    profile_path.parent.mkdir(parents=True, exist_ok=True)
    profile_path.write_text(fit.profile.to_json())
    print(f"wrote {profile_path}")
    return Calibrated(fit, refused, profile_path, directory, notes)


def _too_few_kept(m: Measurement, fit: Fit) -> list[str]:
    """A refusal when more cells were dropped as too noisy than kept: the profile would be
    fitted on what the machine happened to leave quiet."""
    dropped = [s for s in m.skipped if s.endswith("dropped (too noisy)")]
    if len(dropped) <= len(fit.cells):
        return []
    return [
        f"only {len(fit.cells)} of {len(fit.cells) + len(dropped)} cells kept (the others' "
        f"repeats too noisy to measure): the machine was busy; run it on an idle one"
    ]


def _serve_stage(
    args: argparse.Namespace, fit: Fit, notes: list[str], directory: Path
) -> list[str]:
    """Measure the serving side (:mod:`iterserve.bench.calibrate_serving`) into
    ``fit.profile`` and ``notes``; why the profile cannot be trusted (empty: it can): the
    stage failed (the grid's profile is then written beside the points, so that it need not
    be measured again), or its own check is off by more than :data:`SERVE_CHECK_FACTOR` x
    the bound (TPOT p50; TTFT p50 twice that)."""
    import httpx

    from iterserve.bench.calibrate_serving import measure_serving
    from iterserve.bench.fidelity_real import FidelityError

    start = time.perf_counter()
    print("serve stage: a real server, three loads (sequential, concurrent, burst)", flush=True)
    log = directory / "server.log"
    try:
        costs, found, check = measure_serving(fit.profile, args.model, args.dtype, args.smoke, log)
    except (FidelityError, RuntimeError, httpx.HTTPError, OSError) as e:
        grid_only = directory / "profile-grid-only.json"
        grid_only.write_text(fit.profile.to_json())
        return [
            f"serve stage failed ({type(e).__name__}: {e}); the grid's profile, without the "
            f"serving side, is {grid_only} (--no-serve writes it in the first place)"
        ]
    source = fit.profile.source
    fit.profile = fit.profile.model_copy(
        update={
            "serving": costs,
            "source": source.model_copy(update={"notes": [*source.notes, *found]}),
        }
    )
    notes += found
    for line in found:
        print(line)
    print(f"serve stage: {_since(start)}; the server's log: {log}", flush=True)
    bound = SERVE_CHECK_FACTOR * args.max_held_out_error_pct
    return [
        f"serve stage check: {name} p50 {sim * 1e3:.1f} ms simulated, {real * 1e3:.1f} ms "
        f"measured ({(sim / real - 1) * 100:+.0f}% > +-{limit:g}%)"
        for name, real, sim, limit in (
            ("TPOT", check.tpot_measured_s, check.tpot_simulated_s, bound),
            ("TTFT", check.ttft_measured_s, check.ttft_simulated_s, 2 * bound),
        )
        if real > 0 and abs(sim / real - 1) * 100 > limit
    ]


def main(args: argparse.Namespace, measured: Measurement | None = None) -> int:
    """``iterserve bench calibrate``: 0 when the profile was written, 1 when refused
    (``measured``: as for :func:`calibrate`), or when the points are too few to fit."""
    try:
        result = calibrate(args, measured)
    except ValueError as e:  # too few shapes (a grid of one tiny cell, or cells dropped)
        print(f"calibrate: cannot fit a profile: {e}", file=sys.stderr)
        return 1
    return 0 if result.profile_path is not None else 1
