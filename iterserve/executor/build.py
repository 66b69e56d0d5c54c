"""Start-up: load the model and tokenizer, size the KV pool, and build the model runner."""

from __future__ import annotations

import atexit
import functools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from iterserve.config import ConfigError, EngineConfig, GiB
from iterserve.engine.policy import PreemptionCosts
from iterserve.executor.attention import KVCache
from iterserve.executor.cuda_graphs import decode_buckets
from iterserve.executor.memory import (
    CUDA_GRAPH_RESERVE,
    CudaMemoryReader,
    MemoryProfile,
    kv_cache_budget,
    profile_memory,
)
from iterserve.executor.model_runner import TorchModelRunner
from iterserve.executor.tensor_parallel import (
    Workers,
    attach,
    init_group,
    rank_device,
    use_step_timeout,
)
from iterserve.kernels.platform import Platform, TritonPlatform, select_platform
from iterserve.models.llama import LlamaForCausalLM
from iterserve.models.loader import resolve_model_dir
from iterserve.models.parallel import SINGLE, TPGroup, divide, kv_head_range

logger = logging.getLogger(__name__)

_DTYPES = {
    "auto": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM"}


# Entries of oneDNN's primitive cache and of ideep's operator cache (both 1,024 by default).
ONEDNN_CACHE_CAPACITY = 16


def bound_onednn_caches() -> dict[str, str]:
    """Cap the CPU matmul caches unless the environment already sets them; returns the values
    in force (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``).

    oneDNN (behind ``F.linear``, the packed linears and ``bmm`` on CPUs) caches one primitive
    per matmul shape, and ideep one operator per shape, up to 1,024 entries each. Every new
    number of tokens in an iteration is a new shape, so a server's RSS grew for its first
    quarter hour under mixed traffic (+524 MiB in the 30-minute soak) until both caches were
    full. With 16 entries the engine's malloc'd memory stays flat and iterations are as fast
    (measured: docs/reliability.md, "The real model, 30 minutes"). Both are read at the first
    matmul, so this runs before the model is built.
    """
    values = {}
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        values[name] = os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))
    return values


def select_device() -> torch.device:
    """The one place that decides the device: CUDA when present, else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class LoadedModel:
    """Everything start-up discovers; passed to the engine's constructor."""

    config: EngineConfig  # with max_model_len resolved
    runner: TorchModelRunner
    platform: Platform  # the one the model, attention and sampler run on
    tokenizer: Any
    hf_config: Any
    model_dir: Path
    num_kv_blocks: int
    num_host_blocks: int
    eos_token_ids: frozenset[int]
    preemption_costs: PreemptionCosts | None
    workers: Workers | None = None  # ranks 1 .. N-1 under tensor parallelism

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (also at exit)."""
        if self.workers is not None:
            self.workers.close()


def load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(model_dir))
    archs = set(getattr(hf_config, "architectures", None) or [])
    if not archs & _SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{model_dir}: architectures {sorted(archs)} are not supported "
            f"(supported: {sorted(_SUPPORTED_ARCHITECTURES)})"
        )
    return hf_config


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    model_max = int(hf_config.max_position_embeddings)
    asked = config.model.max_model_len
    if asked is not None and asked > model_max:
        raise ConfigError(f"max_model_len {asked} exceeds the model's maximum {model_max}")
    return asked or model_max


def eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config, the model config and the tokenizer, combined."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    sources: list[Any] = [hf_config.eos_token_id, tokenizer.eos_token_id]
    if (model_dir / "generation_config.json").is_file():
        sources.append(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id)
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return frozenset(ids)


def load_model(
    hf_config: Any,
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    platform: Platform,
    tp: TPGroup = SINGLE,
) -> LlamaForCausalLM:
    """Instantiate our Llama forward (rank ``tp.rank``'s shard) on ``platform``, fill it from
    the directory's safetensors files, and pack its linear weights where the platform packs
    them. Each tensor is opened as a lazy slice and only this rank's shard of it is read.

    Raises:
        ConfigError: no safetensors files, or heads that do not divide by ``tp.size``.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no .safetensors weights")
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config, max_position, platform, tp)
    except ValueError as e:  # a degree the heads or the MLP width do not divide by
        raise ConfigError(str(e)) from e

    model.load_weights(checkpoint_slices(files))
    # Rotary tables are computed in float32 and cast here, as Hugging Face casts cos/sin.
    model = model.to(dtype).eval()
    model.pack_linear_weights()
    return model


def checkpoint_slices(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """``(name, lazy slice)`` of every tensor in the safetensors ``files``: nothing is read until
    a weight loader indexes the slice, and then only the indexed part (memory-mapped)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_slice(name)


def num_kv_blocks_for(
    config: EngineConfig,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    profile: Callable[[], tuple[MemoryProfile, int]] | None = None,
    graph_reserve: int = 0,
    num_kv_heads: int | None = None,
) -> int:
    """KV blocks in the pool: ``--num-kv-blocks``, else ``--kv-cache-memory`` bytes, else (on a
    GPU) what :func:`~iterserve.executor.memory.kv_cache_budget` leaves after ``profile``
    (the profiling forward: readings and the dummy pool's bytes) and ``graph_reserve`` bytes,
    else 1 GiB (CPU). ``num_kv_heads``: the KV heads this rank holds (default: the model's).

    Raises:
        ConfigError: the budget holds no block.
    """
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    head_dim = (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )
    per_block = KVCache.bytes_per_block(
        hf_config.num_hidden_layers,
        cache.block_size,
        num_kv_heads or hf_config.num_key_value_heads,
        head_dim,
        dtype,
    )
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif profile is not None:
        readings, dummy_kv_bytes = profile()
        budget = kv_cache_budget(
            readings, cache.gpu_memory_utilization, dummy_kv_bytes, graph_reserve
        )
        logger.info(
            "memory profile: %s, dummy KV %d bytes, graph reserve %d bytes -> KV budget %d bytes",
            readings,
            dummy_kv_bytes,
            graph_reserve,
            budget,
        )
    else:
        budget = GiB
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ConfigError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
    return int(num_blocks)


def use_cuda_graphs(config: EngineConfig, device: torch.device, platform: Platform) -> bool:
    """Decode iterations replay CUDA graphs: on CUDA, on the Triton platform (its attention has
    a launch whose grid depends on static bounds only), unless ``--enforce-eager``."""
    return (
        device.type == "cuda"
        and isinstance(platform, TritonPlatform)
        and not config.model.enforce_eager
    )


def capture_decode_graphs(runner: TorchModelRunner, config: EngineConfig) -> None:
    """Capture the runner's decode CUDA graphs for the buckets of ``max_num_seqs`` (where
    :func:`use_cuda_graphs`; also for callers that build their runner themselves, such as
    benchmarks).

    Raises:
        RuntimeError: a capture failed (the message names ``--enforce-eager``).
    """
    assert config.model.max_model_len is not None, "resolve max_model_len first"
    runner.enable_padded_decode(
        decode_buckets(config.scheduler.max_num_seqs), config.model.max_model_len
    )
    runner.capture_decode_graphs()


@dataclass
class Shard:
    """One rank's part of a replica: its model shard, KV cache and runner."""

    model: LlamaForCausalLM
    platform: Platform
    runner: TorchModelRunner
    num_kv_blocks: int  # the same on every rank (the minimum over them)
    num_host_blocks: int
    eos_token_ids: frozenset[int]  # the driver's (workers do not sample)


def build_shard(config: EngineConfig, model_dir: Path | str, tp: TPGroup = SINGLE) -> Shard:
    """Load rank ``tp.rank``'s shard of the model and build its KV cache and runner. Every rank
    of a group calls this at once (the KV pool is agreed on with a collective).

    Args:
        config: the engine config, ``max_model_len`` resolved.
        model_dir: a resolved Hugging Face model directory.
        tp: this rank's group (one rank: the whole model).

    Raises:
        ConfigError: unsupported model or settings that do not fit it.
    """
    model_dir = Path(model_dir)
    hf_config = load_hf_config(model_dir)
    dtype = _DTYPES[config.model.dtype]
    device = select_device() if tp.size == 1 else rank_device(tp)
    if device.type == "cpu":
        logger.info("CPU matmul cache capacities: %s", bound_onednn_caches())
    try:
        platform = select_platform(config.model.attention_backend, device, dtype)
    except ValueError as e:  # a backend this device or dtype cannot run: a setting's error
        raise ConfigError(str(e)) from e
    assert config.model.max_model_len is not None
    model = load_model(
        hf_config, model_dir, dtype, device, config.model.max_model_len, platform, tp
    )
    graphs = use_cuda_graphs(config, device, platform) and tp.size == 1
    profile: Callable[[], tuple[MemoryProfile, int]] | None = None
    if device.type == "cuda":
        profile = functools.partial(
            profile_memory,
            model,
            config.scheduler.max_num_batched_tokens,
            config.scheduler.max_num_seqs,
            config.model.max_model_len,
            config.cache.block_size,
            CudaMemoryReader(device),
        )
    num_blocks = num_kv_blocks_for(
        config,
        hf_config,
        dtype,
        device,
        profile,
        CUDA_GRAPH_RESERVE if graphs else 0,
        model.num_kv_heads,
    )
    num_blocks = tp.all_reduce_min(num_blocks)  # every rank holds the same block ids
    per_block = KVCache.bytes_per_block(
        len(model.layers), config.cache.block_size, model.num_kv_heads, model.head_dim, dtype
    )
    num_host_blocks = tp.all_reduce_min(int(config.cache.swap_space * GiB) // per_block)
    kv_cache = KVCache(
        len(model.layers),
        num_blocks,
        config.cache.block_size,
        model.num_kv_heads,
        model.head_dim,
        dtype,
        device,
        num_host_blocks,
    )
    eos_ids = frozenset[int]()
    if tp.is_driver:
        from transformers import AutoTokenizer

        eos_ids = eos_token_ids(model_dir, hf_config, AutoTokenizer.from_pretrained(model_dir))
    runner = TorchModelRunner(model, kv_cache, config.model.seed, eos_ids)
    if graphs:
        capture_decode_graphs(runner, config)
    if tp.size > 1:
        use_step_timeout()  # start-up's collectives are done: a step is bounded tighter
    return Shard(model, platform, runner, num_blocks, num_host_blocks, eos_ids)


def build(config: EngineConfig, fail_fast: bool = False) -> LoadedModel:
    """Load the model named by ``config.model.model`` and build a ready model runner; with
    ``tensor_parallel_size`` N > 1 this process is rank 0 and N - 1 worker processes hold the
    other shards (:mod:`~iterserve.executor.tensor_parallel`).

    Args:
        config: the engine config.
        fail_fast: a tensor-parallel worker's death exits this process (the engine process).

    Raises:
        ConfigError: unsupported model or settings that do not fit it.
        ModelNotFoundError: the model cannot be found locally.
    """
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(config.model.model)
    hf_config = load_hf_config(model_dir)
    config = config.with_max_model_len(resolve_max_model_len(config, hf_config))
    size = config.parallel.tensor_parallel_size
    check_tensor_parallel(hf_config, size)
    workers = None
    if size == 1:
        shard = build_shard(config, model_dir)
    else:
        if dist.is_initialized():
            raise ConfigError(
                "this process already holds a tensor-parallel replica (one per process): "
                "close() it first"
            )
        workers = Workers(size, config, str(model_dir), fail_fast)
        atexit.register(workers.close)
        try:
            shard = build_shard(config, model_dir, init_group(0, size, workers.init_method))
        except BaseException:
            workers.close()
            raise
        attach(shard.runner, workers)
    runner = shard.runner
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    costs = None
    if shard.num_host_blocks and config.scheduler.preemption_mode == "auto":
        costs = runner.measure_preemption_costs()
        logger.info("preemption costs: %s", costs)
    logger.info(
        "model %s on %s in %s, %s ops, tensor parallel %d; %d KV blocks of %d tokens, "
        "%d host blocks",
        model_dir,
        runner.device,
        config.model.dtype,
        shard.platform.name,
        size,
        shard.num_kv_blocks,
        config.cache.block_size,
        shard.num_host_blocks,
    )
    return LoadedModel(
        config=config,
        runner=runner,
        platform=shard.platform,
        tokenizer=tokenizer,
        hf_config=hf_config,
        model_dir=model_dir,
        num_kv_blocks=shard.num_kv_blocks,
        num_host_blocks=shard.num_host_blocks,
        eos_token_ids=shard.eos_token_ids,
        preemption_costs=costs,
        workers=workers,
    )


def check_tensor_parallel(hf_config: Any, size: int) -> None:
    """Refuse a degree the model's shapes do not split into, before any process starts.

    Raises:
        ConfigError: the query heads, the MLP width or (for the KV heads) neither the degree
            nor the KV head count divides the other; or CUDA has fewer GPUs than ranks.
    """
    if size == 1:
        return
    kv = int(hf_config.num_key_value_heads)
    try:
        divide(int(hf_config.num_attention_heads), size, "num_attention_heads")
        divide(int(hf_config.intermediate_size), size, "intermediate_size")
        kv_head_range(kv, TPGroup(0, size))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if torch.cuda.is_available() and torch.cuda.device_count() < size:
        raise ConfigError(
            f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} visible"
        )


def build_llm_engine(**kwargs: Any) -> Any:
    """An ``LLMEngine`` on a freshly loaded model (the engine process's factory).

    ``kwargs`` are engine config keywords, as for ``LLM(...)``.
    """
    from iterserve.engine.llm_engine import LLMEngine

    loaded = build(EngineConfig.from_kwargs(**kwargs), fail_fast=True)
    return LLMEngine(
        loaded.config,
        loaded.runner,
        loaded.tokenizer,
        num_kv_blocks=loaded.num_kv_blocks,
        vocab_size=int(loaded.hf_config.vocab_size),
        eos_token_ids=loaded.eos_token_ids,
        num_host_blocks=loaded.num_host_blocks,
        preemption_costs=loaded.preemption_costs,
        model_dir=str(loaded.model_dir),
    )
