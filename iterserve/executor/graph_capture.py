"""Decode CUDA graph capture: when a runner replays graphs, and capturing them."""

from __future__ import annotations

import torch

from iterserve.config import EngineConfig
from iterserve.executor.cuda_graphs import decode_buckets
from iterserve.executor.model_runner import TorchModelRunner
from iterserve.kernels.platform import Platform, TritonPlatform


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
