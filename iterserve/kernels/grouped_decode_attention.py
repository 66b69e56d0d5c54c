"""Paged decode attention in plain torch: gather by length group, then two batched matmuls.

Decodes are batched by similar context length (:func:`length_groups`): the blocks of a group
are gathered into ``[num_kv_heads * group_size, padded_len, head_dim]`` and two batched
matmuls (grouped-query heads share their KV head) attend, masked past each sequence's length,
with the softmax in float32. :func:`plan_decode_groups` runs once per iteration, then
:func:`grouped_decode_attention` once per layer. The reference it is tested against is
:func:`~iterserve.kernels.paged_decode_attention.paged_decode_attention_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from iterserve.kernels.kv_quant import dequantize_kv_rows

# A decode joins a length group while its context is at most this factor times the group's
# shortest (and the group's padding stays bounded by it), or within this many tokens.
MAX_PAD_FACTOR = 2.0
MIN_PAD_TOKENS = 256


def length_groups(seq_lens: list[int]) -> list[list[int]]:
    """Split decodes (by batch index) into groups of similar context length.

    Decode attention pads every sequence of a group to the group's longest, so one 4,000-token
    context in a batch of 300-token ones would make every sequence pay for 4,000. Sorted by
    length, a new group starts when a context exceeds ``MAX_PAD_FACTOR`` times the group's
    shortest and ``MIN_PAD_TOKENS`` more than it: padding costs at most 2x (and one group, the
    common case, when lengths are alike).

    Returns:
        Lists of batch indices; one list holding every index when all lengths are alike.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = []
    shortest = 0
    for i in order:
        n = seq_lens[i]
        if groups and (n <= shortest * MAX_PAD_FACTOR or n - shortest <= MIN_PAD_TOKENS):
            groups[-1].append(i)
        else:
            groups.append([i])
            shortest = n
    if len(groups) == 1:
        return [list(range(len(seq_lens)))]
    return groups


@dataclass(frozen=True)
class DecodeGroup:
    """Gather plan of one length group."""

    rows: list[int]
    index: torch.Tensor | None  # [len(rows)] batch indices; None: all decodes in order
    blocks: torch.Tensor  # [len(rows) * num_blocks]
    padded_len: int
    pad: torch.Tensor  # [1, len(rows), 1, padded_len], True past each sequence's end


def plan_decode_groups(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, seq_lens_list: list[int], block_size: int
) -> list[DecodeGroup]:
    """The gather plans of one iteration's decodes.

    Args:
        block_tables: [num_decodes, max_num_blocks] int64.
        seq_lens: [num_decodes] int64, context length of each decode (its new token included).
        seq_lens_list: the same lengths as Python ints.
        block_size: tokens per KV block.
    """
    return [
        _plan_group(rows, block_tables, seq_lens, seq_lens_list, block_size)
        for rows in length_groups(seq_lens_list)
    ]


def _plan_group(
    rows: list[int],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: list[int],
    block_size: int,
) -> DecodeGroup:
    device = seq_lens.device
    index = torch.tensor(rows, device=device)
    lens = seq_lens[index]
    num_blocks = -(-max(seq_lens_list[r] for r in rows) // block_size)
    padded_len = num_blocks * block_size
    keys = torch.arange(padded_len, device=device)
    return DecodeGroup(
        rows=rows,
        index=None if rows == list(range(len(seq_lens_list))) else index,
        # [len(rows) * num_blocks]: the blocks to gather, sequence after sequence.
        blocks=block_tables[index, :num_blocks].flatten(),
        padded_len=padded_len,
        # [1, len(rows), 1, padded_len]: True past the end of each sequence.
        pad=(keys[None, :] >= lens[:, None])[None, :, None, :],
    )


def grouped_decode_attention(
    q: torch.Tensor,
    groups: list[DecodeGroup],
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each decode's query over its context, one gather and two bmm per group.

    Args:
        q: [num_decodes, num_heads, head_dim].
        groups: :func:`plan_decode_groups` of these decodes.
        key_cache, value_cache: [num_kv_heads, num_blocks, block_size, head_dim], q's dtype,
            or int8 rows with their scales (:mod:`~iterserve.kernels.kv_quant`).
        scale: multiplies q . k (usually head_dim ** -0.5).

    Returns:
        [num_decodes, num_heads, head_dim] in q's dtype.
    """
    if len(groups) == 1 and groups[0].index is None:
        return _attend(q, groups[0], key_cache, value_cache, scale)
    out = torch.empty_like(q)
    for g in groups:
        assert g.index is not None
        out[g.index] = _attend(q[g.index], g, key_cache, value_cache, scale)
    return out


def _attend(
    q: torch.Tensor,
    g: DecodeGroup,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    nd, num_heads, head_dim = q.shape  # q [num_decodes in group, num_heads, head_dim]
    num_kv_heads = key_cache.shape[0]
    group = num_heads // num_kv_heads
    length = g.padded_len
    # [num_kv_heads * nd, padded_len, head_dim], contiguous after the gather.
    ks = key_cache.index_select(1, g.blocks)
    vs = value_cache.index_select(1, g.blocks)
    if key_cache.dtype == torch.int8:  # rows with their scales (kernels/kv_quant.py)
        ks, vs = dequantize_kv_rows(ks, q.dtype), dequantize_kv_rows(vs, q.dtype)
    ks, vs = ks.view(-1, length, head_dim), vs.view(-1, length, head_dim)
    # Query heads of one KV head side by side: [num_kv_heads * nd, group, head_dim]
    qg = (q * scale).view(nd, num_kv_heads, group, head_dim).transpose(0, 1)
    scores = torch.bmm(qg.reshape(-1, group, head_dim), ks.transpose(1, 2))
    scores = scores.float().view(num_kv_heads, nd, group, length)
    probs = scores.masked_fill(g.pad, float("-inf")).softmax(dim=-1)
    probs = probs.to(q.dtype).view(-1, group, length)
    o = torch.bmm(probs, vs)  # [num_kv_heads * num_decodes, group, head_dim]
    return (
        o.view(num_kv_heads, nd, group, head_dim).transpose(0, 1).reshape(nd, num_heads, head_dim)
    )
