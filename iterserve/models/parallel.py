"""The tensor-parallel group a model shard runs in: its rank, the group size and the two
collectives a Megatron-style forward needs (Shoeybi et al., 2019, "Megatron-LM").

A row-parallel linear and the vocab-parallel embedding end in :meth:`TPGroup.all_reduce`
(a sum of ``[num_tokens, hidden]``); the vocab-parallel LM head ends in
:meth:`TPGroup.gather_to_driver` (each rank's logits columns, concatenated on rank 0, the
driver, which samples). With one rank (:data:`SINGLE`) both are the identity and no
``torch.distributed`` group exists.

The group is ``torch.distributed``'s default one: gloo on CPUs (tests, CI), NCCL on GPUs. Every
collective is bounded by the group's timeout (``init_process_group(timeout=...)``), so a dead
or hung rank fails the others instead of holding them forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of its tensor-parallel group.

    Args:
        rank: this shard's index, ``0 <= rank < size``; rank 0 is the driver (it samples).
        size: the tensor-parallel degree (``--tensor-parallel-size``).
    """

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it (any shape and dtype)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV pool every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def from_driver(self, obj: T) -> T:
        """The driver's ``obj`` on every rank (picklable; other ranks' ``obj`` is ignored):
        what one rank decides for all, as the quantization plan it timed."""
        if self.size == 1:
            return obj
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, device=_collective_device())
        return cast(T, box[0])

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` ([rows, cols_per_rank]) along the last dimension on
        the driver -> [rows, size * cols_per_rank]; None on the other ranks."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None


SINGLE = TPGroup()


def _collective_device() -> torch.device:
    """Where the group's tensors live: the rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, exactly.

    Raises:
        ValueError: it does not divide (the message names ``what``).
    """
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size {denominator}"
        )
    return numerator // denominator


def kv_head_range(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """``(first, count)`` of the KV heads rank ``tp.rank`` holds.

    Below the number of KV heads each rank holds ``num_kv_heads / size`` of them; above it each
    holds one, replicated over ``size / num_kv_heads`` consecutive ranks (as vLLM), the one its
    query heads attend to.

    Raises:
        ValueError: neither divides the other.
    """
    if tp.size <= num_kv_heads:
        count = divide(num_kv_heads, tp.size, "num_key_value_heads")
        return tp.rank * count, count
    if tp.size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp.size} is above num_key_value_heads ({num_kv_heads}) "
            "and not a multiple of it: the KV heads cannot be replicated evenly"
        )
    return tp.rank // (tp.size // num_kv_heads), 1
