"""Sizing the KV pool on a GPU from ``--gpu-memory-utilization`` after a profiling forward.

As vLLM: once the weights are loaded, one worst-case iteration (``max_num_batched_tokens``
prompt tokens across up to ``max_num_seqs`` requests, their logits and sampling with every
processing step on) runs over a small dummy KV pool; its peak torch allocation and the device
memory in use outside torch (the CUDA context, cuBLAS and Triton workspaces) are what the
serving iterations need besides the pool, and the pool gets the rest of
``total x utilization``::

    budget = total * utilization - (peak_torch - dummy_kv) - non_torch - graph_reserve

:func:`kv_cache_budget` is that arithmetic; :func:`profile_memory` runs the forward and reads
the memory through a :class:`MemoryReader` (:class:`CudaMemoryReader` on a GPU, a fake in the
CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from iterserve.config import ConfigError
from iterserve.engine.outputs import ScheduledRequest, SchedulerOutput
from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.attention import KVCache
from iterserve.executor.model_runner import TorchModelRunner
from iterserve.models.llama import LlamaForCausalLM

MiB = 1 << 20
# Set aside for the captured CUDA graphs' memory pool (decode activations and logits of the
# largest bucket: under 200 MiB for a Llama-3-8B shape at 256 sequences, with margin).
CUDA_GRAPH_RESERVE = 512 * MiB

# Every sampling step on, so the profile allocates what the heaviest batch does (the float32
# logits copy, log-softmax for logprobs, penalty counts, the top-k/top-p sort, the draw).
_WORST_CASE_SAMPLING = SamplingParams(
    temperature=0.8,
    top_p=0.9,
    top_k=50,
    min_p=0.05,
    repetition_penalty=1.1,
    frequency_penalty=0.1,
    logprobs=5,
)


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory readings after the profiling forward, in bytes.

    Attributes:
        total: the device's memory.
        peak_torch: torch's peak allocation during the forward (weights, activations, logits,
            sampling and the dummy KV pool).
        non_torch: in use outside torch's caching allocator (CUDA context, library
            workspaces): device use minus what torch has reserved.
    """

    total: int
    peak_torch: int
    non_torch: int


class MemoryReader(Protocol):
    """Where :func:`profile_memory` reads device memory (bytes)."""

    def reset_peak(self) -> None:
        """Start a new peak (called before the profiling forward)."""

    def read(self) -> MemoryProfile:
        """The readings since :meth:`reset_peak` (after the forward has finished)."""


class CudaMemoryReader:
    """:class:`MemoryReader` of one CUDA device (torch's allocator statistics)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> MemoryProfile:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return MemoryProfile(
            total=total,
            peak_torch=torch.cuda.max_memory_allocated(self.device),
            non_torch=max(total - free - reserved, 0),
        )


def kv_cache_budget(
    profile: MemoryProfile, utilization: float, dummy_kv_bytes: int, graph_reserve: int = 0
) -> int:
    """Bytes left for the KV pool: ``total * utilization`` minus the profiled peak without the
    dummy pool, the non-torch memory and ``graph_reserve`` (CUDA graphs' pool, 0 without
    graphs); all in bytes.

    Raises:
        ConfigError: nothing is left for the KV cache (the message gives every term).
    """
    allowed = int(profile.total * utilization)
    activations = profile.peak_torch - dummy_kv_bytes
    budget = allowed - activations - profile.non_torch - graph_reserve
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory is left for the KV cache: {utilization:g} x {profile.total} bytes "
            f"= {allowed}, minus the profiled peak of weights and activations {activations}, "
            f"non-torch memory {profile.non_torch} and CUDA graph reserve {graph_reserve} "
            f"leaves {budget}; raise --gpu-memory-utilization, lower --max-num-batched-tokens "
            f"or --max-num-seqs, or pass --enforce-eager"
        )
    return budget


def worst_case_batch(
    num_tokens: int, num_seqs: int, max_model_len: int, block_size: int, vocab_size: int = 100
) -> tuple[list[ScheduledRequest], int]:
    """The profiling iteration: ``num_tokens`` prompt tokens split as evenly as possible across
    ``min(num_seqs, num_tokens)`` requests (each at most ``max_model_len``), every one
    sampled; and the number of blocks their tables use (numbered from 0, disjoint)."""
    num_reqs = max(min(num_seqs, num_tokens), 1)
    base, extra = divmod(num_tokens, num_reqs)
    scheduled = []
    next_block = 0
    for i in range(num_reqs):
        length = max(min(base + (i < extra), max_model_len), 1)
        num_blocks = -(-length // block_size)
        table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        token_ids = [(i + t) % vocab_size for t in range(length)]
        scheduled.append(
            ScheduledRequest(
                f"profile-{i}", token_ids, 0, table, True, _WORST_CASE_SAMPLING, token_ids
            )
        )
    return scheduled, next_block


@torch.inference_mode()
def profile_memory(
    model: LlamaForCausalLM,
    num_tokens: int,
    num_seqs: int,
    max_model_len: int,
    block_size: int,
    reader: MemoryReader,
) -> tuple[MemoryProfile, int]:
    """Run the worst-case iteration of :func:`worst_case_batch` over a dummy KV pool just big
    enough for it and read the memory around it.

    Args:
        model: the loaded model on its device, in its serving dtype.
        num_tokens, num_seqs: ``max_num_batched_tokens`` and ``max_num_seqs``.
        max_model_len, block_size: as configured.
        reader: where memory is read.

    Returns:
        The readings and the dummy pool's bytes (part of the peak; not serving memory).
    """
    scheduled, num_blocks = worst_case_batch(
        num_tokens, num_seqs, max_model_len, block_size, model.config.vocab_size
    )
    weight = model.embed_tokens.weight
    reader.reset_peak()
    kv = KVCache(
        len(model.layers),
        num_blocks,
        block_size,
        model.num_kv_heads,
        model.head_dim,
        weight.dtype,
        weight.device,
    )
    runner = TorchModelRunner(model, kv, seed=0)
    runner.execute_model(SchedulerOutput(scheduled=scheduled))
    profile = reader.read()
    dummy_bytes = num_blocks * kv.bytes_per_token * block_size
    del runner, kv
    return profile, dummy_bytes
