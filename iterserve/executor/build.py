"""Start-up, the composition of a replica: load the model and tokenizer, size the KV pools,
build the model runner (tensor-parallel when asked), and hand them to the engine factory.

The concepts it composes live in their own modules: :mod:`~iterserve.executor.device`,
:mod:`~iterserve.executor.weights`, :mod:`~iterserve.executor.kv_sizing`,
:mod:`~iterserve.executor.graph_capture` and :mod:`~iterserve.executor.tensor_parallel`.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from iterserve.config import ConfigError, EngineConfig
from iterserve.engine.factory import ModelInfo, build_engine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.tokenizer import Tokenizer
from iterserve.executor.device import DTYPES, bound_onednn_caches, rank_device, select_device
from iterserve.executor.graph_capture import capture_decode_graphs, use_cuda_graphs
from iterserve.executor.kv_sizing import build_kv_cache
from iterserve.executor.model_runner import TorchModelRunner
from iterserve.executor.quantization import check_quantization
from iterserve.executor.tensor_parallel import (
    TensorParallelRunner,
    Workers,
    init_group,
    use_step_timeout,
)
from iterserve.executor.weights import (
    check_tensor_parallel,
    eos_token_ids,
    load_hf_config,
    load_model,
    load_tokenizer,
    resolve_max_model_len,
)
from iterserve.kernels.platform import Platform, select_platform
from iterserve.models.llama import LlamaForCausalLM
from iterserve.models.loader import resolve_model_dir
from iterserve.models.parallel import SINGLE, TPGroup

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """Everything start-up discovers: the runner, and what the engine factory needs of it."""

    config: EngineConfig  # with max_model_len resolved
    runner: TorchModelRunner | TensorParallelRunner
    platform: Platform  # the one the model, attention and sampler run on
    tokenizer: Tokenizer
    hf_config: Any
    model_dir: Path
    num_kv_blocks: int
    num_host_blocks: int
    eos_token_ids: frozenset[int]

    @property
    def driver(self) -> TorchModelRunner:
        """Rank 0's runner: its model (shard) and KV cache; the whole model with one rank."""
        if isinstance(self.runner, TensorParallelRunner):
            return self.runner.driver
        return self.runner

    @property
    def info(self) -> ModelInfo:
        """What :func:`~iterserve.engine.factory.build_engine` needs of the model."""
        return ModelInfo(
            vocab_size=int(self.hf_config.vocab_size),
            eos_token_ids=self.eos_token_ids,
            num_kv_blocks=self.num_kv_blocks,
            num_host_blocks=self.num_host_blocks,
            model_dir=str(self.model_dir),
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (idempotent; also
        at exit). Nothing to do for a single-rank runner."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()
            atexit.unregister(self.runner.close)


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
    dtype = DTYPES[config.model.dtype]
    device = select_device() if tp.size == 1 else rank_device(tp)
    if device.type == "cpu":
        logger.info("CPU matmul cache capacities: %s", bound_onednn_caches())
    try:
        platform = select_platform(config.model.attention_backend, device, dtype)
    except ValueError as e:  # a backend this device or dtype cannot run: a setting's error
        raise ConfigError(str(e)) from e
    assert config.model.max_model_len is not None
    if config.cache.kv_cache_dtype == "int8" and not platform.int8_kv_cache:
        raise ConfigError(
            f"kv_cache_dtype int8 runs on the cpu and torch attention backends, not "
            f"{platform.name} (on CUDA or under TRITON_INTERPRET=1, pass --attention-backend "
            f"torch or leave kv_cache_dtype auto)"
        )
    quantization = config.model.quantization
    gguf = check_quantization(quantization, device, dtype, tp.size, config.model.model)
    model = load_model(
        hf_config, model_dir, dtype, device, config.model.max_model_len, platform, tp,
        quantization, gguf,
    )  # fmt: skip
    graphs = use_cuda_graphs(config, device, platform) and tp.size == 1
    kv_cache = build_kv_cache(config, hf_config, model, dtype, device, graphs, tp)
    eos_ids = frozenset[int]()
    if tp.is_driver:
        eos_ids = eos_token_ids(model_dir, hf_config, load_tokenizer(model_dir))
    runner = TorchModelRunner(model, kv_cache, config.model.seed, eos_ids)
    if graphs:
        capture_decode_graphs(runner, config)
    if tp.size > 1:
        use_step_timeout()  # start-up's collectives are done: a step is bounded tighter
    return Shard(model, platform, runner, kv_cache.num_blocks, kv_cache.num_host_blocks, eos_ids)


def build(config: EngineConfig, fail_fast: bool = False) -> LoadedModel:
    """Load the model named by ``config.model.model`` and build a ready model runner; with
    ``tensor_parallel_size`` N > 1 this process is rank 0 and N - 1 worker processes hold the
    other shards (:mod:`~iterserve.executor.tensor_parallel`); ``close()`` the result to stop
    them.

    Args:
        config: the engine config.
        fail_fast: a tensor-parallel worker's death exits this process (the engine process).

    Raises:
        ConfigError: unsupported model or settings that do not fit it, or a tensor-parallel
            replica already open in this process.
        ModelNotFoundError: the model cannot be found locally.
    """
    model_dir = resolve_model_dir(config.model.model)
    hf_config = load_hf_config(model_dir)
    config = config.with_max_model_len(resolve_max_model_len(config, hf_config))
    size = config.parallel.tensor_parallel_size
    check_tensor_parallel(hf_config, size)
    runner: TorchModelRunner | TensorParallelRunner
    if size == 1:
        shard = build_shard(config, model_dir)
        runner = shard.runner
    else:
        shard, runner = _build_tensor_parallel(config, model_dir, fail_fast)
    tokenizer = load_tokenizer(model_dir)
    logger.info(
        "model %s on %s in %s, %s ops, tensor parallel %d; %d KV blocks of %d tokens "
        "(KV cache dtype %s), %d host blocks",
        model_dir,
        runner.device,
        config.model.dtype,
        shard.platform.name,
        size,
        shard.num_kv_blocks,
        config.cache.block_size,
        config.cache.kv_cache_dtype,
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
    )


def _build_tensor_parallel(
    config: EngineConfig, model_dir: Path, fail_fast: bool
) -> tuple[Shard, TensorParallelRunner]:
    """Start the workers, build the driver's shard with them, and wrap its runner."""
    if dist.is_initialized():
        raise ConfigError(
            "this process already holds a tensor-parallel replica (one per process): "
            "close() it first"
        )
    size = config.parallel.tensor_parallel_size
    workers = Workers(size, config, str(model_dir), fail_fast)
    try:
        shard = build_shard(config, model_dir, init_group(0, size, workers.init_method))
    except BaseException:
        workers.close()
        raise
    runner = TensorParallelRunner(shard.runner, workers)
    atexit.register(runner.close)
    return shard, runner


def build_llm_engine(**kwargs: Any) -> LLMEngine:
    """An ``LLMEngine`` on a freshly loaded model (the engine process's factory).

    ``kwargs`` are engine config keywords, as for ``LLM(...)``.
    """
    loaded = build(EngineConfig.from_kwargs(**kwargs), fail_fast=True)
    return build_engine(loaded.config, loaded.runner, loaded.tokenizer, loaded.info)
