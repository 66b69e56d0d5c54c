"""Simulated replicas: the real engine over the simulated runner, and ``serve --simulate``.

:func:`build_simulated_engine` makes an :class:`~iterserve.engine.llm_engine.LLMEngine` (with
the engine factory) whose runner is a :class:`~iterserve.sim.runner.SimulatedModelRunner`,
sized from the profile: the KV pool is the profile's unless ``--num-kv-blocks`` or
``--kv-cache-memory`` say otherwise (bytes over the profile's KV bytes per token),
``max_model_len`` at most the profile's, swap space in blocks of the profile's KV size, and
``tensor_parallel_size`` must be the profile's degree (a simulated 4-GPU replica is one
process). :func:`serve_simulated` runs the whole HTTP server
over it in one process: the engine loop on a thread behind
:class:`~iterserve.engine.async_engine.AsyncEngine`.

Time: a live replica's clock is :class:`ScaledClock` (profile seconds; with
``--simulate-speed X`` it runs X times faster than the wall clock, and every latency the
server reports, metrics included, is in profile time). A replay uses :class:`VirtualClock`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from iterserve.config import (
    ConfigError,
    EngineConfig,
    ServerConfig,
    SimulationConfig,
)
from iterserve.engine.factory import ModelInfo, build_engine, num_host_blocks
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.messages import Clock
from iterserve.kv_events import KVEventsBindError
from iterserve.sim.profile import MAX_NUM_BLOCKS, LatencyProfile, OutputLengths, load_profile
from iterserve.sim.runner import SimulatedModelRunner
from iterserve.sim.tokenizer import CharTokenizer, FileTokenizer, load_tokenizer

logger = logging.getLogger("iterserve.sim")

SimTokenizer = CharTokenizer | FileTokenizer


class VirtualClock:
    """Seconds that move only when the simulation advances them (a replay)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ScaledClock:
    """Profile seconds of a live replica: the monotonic clock, ``speed`` times faster."""

    def __init__(self, speed: float = 1.0) -> None:
        self.speed = speed
        self._origin = time.monotonic()

    def __call__(self) -> float:
        return self._origin + (time.monotonic() - self._origin) * self.speed

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of profile time."""
        time.sleep(seconds / self.speed)


def parse_output_lengths(spec: str) -> OutputLengths:
    """``constant:N``, ``uniform:MIN:MAX`` or ``lognormal:MEDIAN:SIGMA[:MAX]`` (lognormal
    draws above ``MAX``, default 2048, are clipped to it).

    Raises:
        ConfigError: another form.
    """
    kind, _, rest = spec.partition(":")
    try:
        values = [float(v) for v in rest.split(":")] if rest else []
    except ValueError:
        values = []
    if values and not all(v > 0 and v < math.inf for v in values[:1] + values[2:]):
        raise ConfigError(f"simulate_output_len {spec!r}: lengths must be positive numbers")
    try:
        if kind == "constant" and len(values) == 1:
            n = int(values[0])
            return OutputLengths(distribution="constant", median=n, min=n, max=n)
        if kind == "uniform" and len(values) == 2 and values[0] <= values[1]:
            return OutputLengths(distribution="uniform", min=int(values[0]), max=int(values[1]))
        if kind == "lognormal" and len(values) in (2, 3) and 0 <= values[1] < math.inf:
            extra = {"max": int(values[2])} if len(values) == 3 else {}
            return OutputLengths(
                distribution="lognormal", median=values[0], sigma=values[1], **extra
            )
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise ConfigError(f"simulate_output_len {spec!r}: {problems}") from e
    raise ConfigError(
        f"simulate_output_len {spec!r}: expected constant:N, uniform:MIN:MAX (MIN <= MAX) or "
        "lognormal:MEDIAN:SIGMA[:MAX] (lengths >= 1, SIGMA >= 0)"
    )


def resolve_config(profile: LatencyProfile, engine_kwargs: dict[str, Any]) -> EngineConfig:
    """The engine config of a simulated replica (see the module docstring).

    Raises:
        ConfigError, TypeError: invalid settings, or ones the profile cannot model.
    """
    config = EngineConfig.from_kwargs(**engine_kwargs)
    tp = profile.model.tensor_parallel_size
    if engine_kwargs.get("tensor_parallel_size", tp) != tp:
        raise ConfigError(
            f"tensor_parallel_size={engine_kwargs['tensor_parallel_size']} but the profile "
            f"{profile.name!r} was measured at tensor parallel degree {tp}"
        )
    model_max = profile.model.max_model_len
    asked = config.model.max_model_len
    if asked is not None and asked > model_max:
        raise ConfigError(f"max_model_len {asked} exceeds the profile's maximum {model_max}")
    model = dataclasses.replace(config.model, max_model_len=asked or model_max)
    if config.model.model == "default" and config.model.served_model_name is None:
        model = dataclasses.replace(model, served_model_name=profile.model.name)
    parallel = dataclasses.replace(config.parallel, tensor_parallel_size=tp)
    return dataclasses.replace(config, model=model, parallel=parallel)


def num_kv_blocks(profile: LatencyProfile, config: EngineConfig) -> int:
    """KV blocks of the simulated pool (see the module docstring)."""
    cache, spec = config.cache, profile.kv_cache
    if cache.num_kv_blocks is not None:
        return _bounded_blocks(cache.num_kv_blocks, "KV pool")
    if cache.kv_cache_memory is not None:
        blocks = cache.kv_cache_memory // (cache.block_size * spec.kv_bytes_per_token)
    else:  # the profile's pool, in this block size
        blocks = spec.num_blocks * spec.block_size // cache.block_size
    if blocks < 1:
        raise ConfigError("the KV cache budget holds no block")
    return _bounded_blocks(int(blocks), "KV pool")


def _bounded_blocks(num_blocks: int, what: str) -> int:
    if num_blocks > MAX_NUM_BLOCKS:
        raise ConfigError(
            f"a simulated {what} of {num_blocks} blocks is more than {MAX_NUM_BLOCKS} "
            "(each block costs the simulator memory: ask for fewer)"
        )
    return num_blocks


def build_simulated_engine(
    profile: LatencyProfile,
    engine_kwargs: dict[str, Any],
    wait: Callable[[float], None],
    clock: Clock,
    tokenizer: SimTokenizer | None = None,
    include_engine_overhead: bool = False,
    output_lengths: OutputLengths | None = None,
) -> tuple[LLMEngine, SimTokenizer]:
    """A real engine over the simulated runner, and the tokenizer it detokenizes with.

    Args:
        engine_kwargs: engine flags, as ``LLM(...)`` keywords; ``model`` names the tokenizer
            directory (``default`` or a directory without ``tokenizer.json``: ~4 characters
            per token).
        wait: how the runner waits out an iteration (profile seconds).
        clock: the engine's clock (profile seconds).
        tokenizer: share one tokenizer between replicas (default: loaded from ``model``).

    Raises:
        ConfigError, TypeError: invalid settings.
    """
    config = resolve_config(profile, engine_kwargs)
    if engine_kwargs.get("dtype", "auto") not in ("auto", profile.model.dtype):
        logger.warning(
            "dtype %s ignored: the profile %r was measured in %s",
            engine_kwargs["dtype"],
            profile.name,
            profile.model.dtype,
        )
    if config.cache.kv_cache_dtype != "auto":
        logger.warning(
            "kv_cache_dtype %s ignored: the profile %r's KV pool holds %d bytes per token "
            "(calibrate a profile on a replica serving with it)",
            config.cache.kv_cache_dtype,
            profile.name,
            profile.kv_cache.kv_bytes_per_token,
        )
    if tokenizer is None:
        model = config.model.model
        try:
            tokenizer = load_tokenizer(
                None if model == "default" else model, profile.model.vocab_size
            )
        except ValueError as e:
            raise ConfigError(str(e)) from e
    eos = tokenizer.eos_token_id
    eos_ids = frozenset([eos] if eos is not None else profile.model.eos_token_ids)
    runner = SimulatedModelRunner(
        profile,
        wait,
        tokenizer.ordinary_token_ids(),
        min(eos_ids),
        seed=config.model.seed,
        include_engine_overhead=include_engine_overhead,
        output_lengths=output_lengths,
    )
    bytes_per_block = config.cache.block_size * profile.kv_cache.kv_bytes_per_token
    num_host = _bounded_blocks(num_host_blocks(config.cache, bytes_per_block), "host swap pool")
    info = ModelInfo(
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=eos_ids,
        num_kv_blocks=num_kv_blocks(profile, config),
        num_host_blocks=num_host,
        model_dir=config.model.model if isinstance(tokenizer, FileTokenizer) else None,
    )
    engine = build_engine(config, runner, tokenizer, info, clock)
    return engine, tokenizer


def serve_simulated(
    engine_kwargs: dict[str, Any], server_config: ServerConfig, sim: SimulationConfig
) -> int:
    """``iterserve serve --simulate``: run a simulated replica until it is stopped; the exit
    code.

    Raises:
        ConfigError, TypeError, ProfileError: invalid settings or profile.
    """
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.server.app import build_app
    from iterserve.server.launch import kv_events_config, run_server, setup_logging
    from iterserve.server.state import served_model_name

    setup_logging()
    assert sim.simulate is not None
    profile = load_profile(sim.simulate)
    output_lengths = (
        parse_output_lengths(sim.simulate_output_len) if sim.simulate_output_len else None
    )
    clock = ScaledClock(sim.simulate_speed)
    engine, tokenizer = build_simulated_engine(
        profile, engine_kwargs, clock.sleep, clock, output_lengths=output_lengths
    )
    logger.info(
        "simulated replica: profile %s (%s), %d KV blocks of %d tokens, speed x%g, %s",
        profile.name,
        profile.source.hardware,
        engine.scheduler.kv.num_blocks,
        engine.config.cache.block_size,
        sim.simulate_speed,
        "tokenizer " + str(engine.model_dir)
        if engine.model_dir
        else "~4 characters per token (no tokenizer file)",
    )
    kv_events = kv_events_config(server_config, served_model_name(engine.config))
    try:
        publisher = kv_events.open() if kv_events is not None else None
    except KVEventsBindError as e:
        raise ConfigError(str(e)) from e
    try:
        client = AsyncEngine(engine, server_config.telemetry_db, publisher)
        app = build_app(client, server_config, tokenizer=tokenizer, clock=clock)
        return run_server(app, server_config)
    finally:
        if publisher is not None:
            publisher.close()  # the engine loop closed it, unless it never started
