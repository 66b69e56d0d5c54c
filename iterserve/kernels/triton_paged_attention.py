"""Paged attention over a ragged batch of prefill chunks and decodes, in Triton.

One launch serves the whole iteration in the layout of
:class:`~iterserve.executor.attention.AttentionMetadata`: request ``i`` owns query rows
``query_start_loc[i] .. query_start_loc[i + 1]`` (1 for a decode, a chunk for a prefill) and,
with this iteration's KV already written, ``seq_lens[i]`` tokens of context in the blocks of
``block_tables[i]``. Query ``j`` of a request with ``q_len`` query tokens sits at position
``seq_len - q_len + j`` and attends causally to keys ``0 ..`` that position::

    context of request i (seq_len = 37, block_size = 16, q_len = 7):
    position   0 ............. 15 | 16 ........... 29 30 ... 36 |
    block      block_tables[i, 0] | block_tables[i, 1]    | block_tables[i, 2]
                                              queries: 30 ... 36 (the chunk starts mid-block)

K and V are read through the block table in place (vLLM's PagedAttention, Kwon et al. 2023,
"Efficient Memory Management for Large Language Model Serving with PagedAttention"), one
block per step of an online softmax (FlashAttention-2, Dao 2023, "FlashAttention-2: Faster
Attention with Better Parallelism and Work Partitioning", Algorithm 1). Grouped-query
attention packs the ``num_heads // num_kv_heads`` query heads sharing a KV head into the rows
of one program, so each KV block is loaded once per group.

For long contexts at small batch the key range is split across ``num_splits`` programs
(flash-decoding: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context
inference"): each writes its partial output and log-sum-exp, and :func:`_reduce_splits_kernel`
combines them.

:func:`paged_attention_reference` is the plain-torch definition the kernel is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Tokens of one query tile per program (times the GQA group, the rows of the score tile).
_BLOCK_M = 16
# The smallest dot on NVIDIA GPUs is 16 x 16 x 16: tiles have at least 16 rows.
_MIN_ROWS = 16
# Flash-decoding: split when fewer than this many (request, KV head) programs fill the GPU ...
_MIN_PROGRAMS = 128
# ... into key ranges of at least this many tokens each.
_MIN_SPLIT_TOKENS = 512
_MAX_SPLITS = 16


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]; or partials when NUM_SPLITS > 1
    lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32 (used when NUM_SPLITS > 1)
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_kv_heads, num_blocks, BLOCK_SIZE, HEAD_DIM]
    v_cache_ptr,
    block_tables_ptr,  # [num_reqs, max_num_blocks] int64
    seq_lens_ptr,  # [num_reqs] int64
    query_start_loc_ptr,  # [num_reqs + 1] int64
    scale,
    blocks_per_split,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_o_s,
    stride_lse_t,
    stride_lse_h,
    stride_c_h,
    stride_c_b,
    stride_c_t,
    stride_bt_r,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # float32 dots in full precision (not TF32)
):
    req_idx = tl.program_id(0)
    tile_idx = tl.program_id(1)
    kv_head_idx = tl.program_id(2) // NUM_SPLITS
    split_idx = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + req_idx)
    q_len = tl.load(query_start_loc_ptr + req_idx + 1) - q_start
    if tile_idx * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req_idx)
    num_computed = seq_len - q_len

    # Row r of the tile: query token tile_idx * BLOCK_M + r // GROUP_PAD, head r % GROUP_PAD
    # of the KV head's group.
    offs_r = tl.arange(0, BLOCK_M * GROUP_PAD)
    offs_tok = tile_idx * BLOCK_M + offs_r // GROUP_PAD  # [ROWS] query index in the request
    offs_head = kv_head_idx * GROUP + offs_r % GROUP_PAD  # [ROWS]
    row_mask = (offs_tok < q_len) & (offs_r % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_SIZE)

    q_rows = (q_start + offs_tok) * stride_q_t + offs_head * stride_q_h  # [ROWS]
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    query_pos = num_computed + offs_tok  # [ROWS] position of each row's token

    # Keys this tile can see end at its last token's position; this split covers its share.
    last_pos = num_computed + tl.minimum(tile_idx * BLOCK_M + BLOCK_M, q_len)  # exclusive
    blk_start = split_idx * blocks_per_split
    blk_end = tl.minimum(blk_start + blocks_per_split, tl.cdiv(last_pos, BLOCK_SIZE))

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    kv_head_off = kv_head_idx.to(tl.int64) * stride_c_h
    # A while loop, not `for blk in range(blk_start, blk_end)`: Triton 3.6's interpreter
    # cannot take loaded values as range bounds under NumPy >= 2.4 (triton-lang/triton#9171).
    blk = blk_start
    while blk < blk_end:
        block_id = tl.load(block_tables_ptr + req_idx * stride_bt_r + blk)
        kv_offs = (
            kv_head_off + block_id * stride_c_b + offs_n[:, None] * stride_c_t + offs_d[None, :]
        )
        k = tl.load(k_cache_ptr + kv_offs)  # [BLOCK_SIZE, HEAD_DIM]
        v = tl.load(v_cache_ptr + kv_offs)
        # [ROWS, BLOCK_SIZE]; IEEE_DOT is a constexpr, so only one branch compiles.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE_DOT else tl.dot(q, tl.trans(k))
        s = s * scale
        key_pos = blk * BLOCK_SIZE + offs_n
        visible = (key_pos[None, :] <= query_pos[:, None]) & row_mask[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf: subtract 0 instead (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_v = p.to(v.dtype)
        pv = tl.dot(p_v, v, input_precision="ieee") if IEEE_DOT else tl.dot(p_v, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        blk += 1

    out_rows = (q_start + offs_tok) * stride_o_t + offs_head * stride_o_h  # [ROWS]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        out_offs = out_rows[:, None] + offs_d[None, :]
        tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        out_offs = out_rows[:, None] + split_idx * stride_o_s + offs_d[None, :]
        tl.store(out_ptr + out_offs, o, mask=row_mask[:, None])
        # log-sum-exp of the split's scores; -inf where it saw no key
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        lse_rows = (q_start + offs_tok) * stride_lse_t + offs_head * stride_lse_h + split_idx
        tl.store(lse_ptr + lse_rows, lse, mask=row_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    partial_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM] float32
    lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    num_heads,
    stride_o_t,
    stride_o_h,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # One program per (token, head): out = sum_s exp(lse_s - lse) * partial_s.
    row = tl.program_id(0)
    token_idx = row // num_heads
    head_idx = row % num_heads
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + row * NUM_SPLITS + offs_s)  # [NUM_SPLITS]
    lse_max = tl.max(lse, axis=0)  # finite: split 0 always sees key 0
    w = tl.exp(lse - lse_max)
    w = w / tl.sum(w, axis=0)
    partial = tl.load(
        partial_ptr + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :]
    )  # [NUM_SPLITS, HEAD_DIM]
    o = tl.sum(partial * w[:, None], axis=0)
    out_offs = token_idx * stride_o_t + head_idx * stride_o_h + offs_d
    tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty))


def default_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Flash-decoding's split count: 1 unless too few (request, KV head) programs fill the
    device and the longest context (tokens) leaves each split at least 512 tokens; a power of
    two, at most 16."""
    splits = 1
    while (
        splits < _MAX_SPLITS
        and num_reqs * num_kv_heads * splits < _MIN_PROGRAMS
        and max_seq_len >= 2 * splits * _MIN_SPLIT_TOKENS
    ):
        splits *= 2
    return splits


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of every request's query tokens over its cached context.

    Args:
        q: [num_tokens, num_heads, head_dim] float16, bfloat16 or float32, heads and dims
            contiguous; rows of request ``i`` are ``query_start_loc[i] .. query_start_loc[i+1]``.
        key_cache, value_cache: [num_kv_heads, num_blocks, block_size, head_dim] contiguous,
            q's dtype, holding every request's context (this iteration's KV included);
            ``num_heads`` a multiple of ``num_kv_heads``; ``block_size`` a power of two in
            [16, 128]; ``head_dim`` a power of two in [16, 256].
        block_tables: [num_reqs, max_num_blocks] int64, contiguous rows; token ``t`` of request
            ``i`` sits at offset ``t % block_size`` of block ``block_tables[i, t // block_size]``.
            Not checked against the pool here (that would sync the device every layer):
            the platform checks the tables once per iteration.
        seq_lens: [num_reqs] int64, context length (tokens) including the query tokens.
        query_start_loc: [num_reqs + 1] int64, cumulative query lengths (cu_seqlens_q);
            each request has ``1 <= q_len <= seq_len``.
        max_query_len, max_seq_len: the largest ``q_len`` and ``seq_len`` (tokens), as ints.
        scale: multiplies q . k (usually head_dim ** -0.5).
        num_splits: key-range splits (flash-decoding), a power of two; None picks
            :func:`default_num_splits`.
        out: optional [num_tokens, num_heads, head_dim] output, q's dtype, contiguous.

    Returns:
        [num_tokens, num_heads, head_dim] in q's dtype (scores and softmax in float32).

    Raises:
        ValueError: on dtypes, devices, shapes or layouts the kernel does not take.
    """
    _check_inputs(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {tuple(q.shape)} {q.dtype}")
    if num_tokens == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_reqs, num_kv_heads, max_seq_len)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = min(_BLOCK_M, triton.next_power_of_2(max(max_query_len, 1)))
    block_m = max(block_m, _MIN_ROWS // min(group_pad, _MIN_ROWS))
    max_num_blocks = -(-max_seq_len // block_size)
    blocks_per_split = -(-max_num_blocks // num_splits)
    grid = (num_reqs, triton.cdiv(max(max_query_len, 1), block_m), num_kv_heads * num_splits)
    if num_splits == 1:
        target, lse = out, out  # lse unused
        stride_o = (out.stride(0), out.stride(1), 0)
        stride_lse = (0, 0)
    else:
        target = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        stride_o = (target.stride(0), target.stride(1), target.stride(2))
        stride_lse = (lse.stride(0), lse.stride(1))
    _paged_attention_kernel[grid](
        target,
        lse,
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        blocks_per_split,
        q.stride(0),
        q.stride(1),
        *stride_o,
        *stride_lse,
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        IEEE_DOT=q.dtype == torch.float32,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens * num_heads,)](
            out,
            target,
            lse,
            num_heads,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
        )
    return out


def _check_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if q.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"q must be [num_tokens, num_heads, head_dim] and both caches [num_kv_heads, "
            f"num_blocks, block_size, head_dim], got {tuple(q.shape)}, {tuple(key_cache.shape)}, "
            f"{tuple(value_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, _, block_size, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit caches {tuple(key_cache.shape)}: head_dim must "
            f"match and num_heads be a multiple of num_kv_heads"
        )
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if block_size & (block_size - 1) or not 16 <= block_size <= 128:
        raise ValueError(f"block_size must be a power of two in [16, 128], got {block_size}")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise ValueError(f"caches must be {q.dtype}, got {key_cache.dtype}, {value_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError("q's heads and dims must be contiguous")
    num_reqs = seq_lens.shape[0]
    for name, t, shape in (
        ("seq_lens", seq_lens, (num_reqs,)),
        ("query_start_loc", query_start_loc, (num_reqs + 1,)),
        ("block_tables", block_tables, (num_reqs, block_tables.shape[-1])),
    ):
        if t.dtype != torch.int64 or tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(f"{name} must be int64 {shape} with a contiguous last dim")
    devices = {t.device for t in (q, key_cache, value_cache, block_tables, seq_lens)}
    if len(devices | {query_start_loc.device}) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def paged_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The definition :func:`paged_attention` computes, in plain torch in q's dtype (pass
    float64 tensors for an exact reference): gathers each request's context, one request at a
    time. Same arguments and result as :func:`paged_attention`."""
    out = torch.empty_like(q)
    num_kv_heads, _, block_size, _ = key_cache.shape
    group = q.shape[1] // num_kv_heads
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        blocks = block_tables[i, : -(-seq_len // block_size)]
        # [num_kv_heads, seq_len, head_dim] -> [num_heads, seq_len, head_dim]
        k = key_cache[:, blocks].flatten(1, 2)[:, :seq_len].repeat_interleave(group, dim=0)
        v = value_cache[:, blocks].flatten(1, 2)[:, :seq_len].repeat_interleave(group, dim=0)
        qi = q[start:end].transpose(0, 1)  # [num_heads, q_len, head_dim]
        scores = qi @ k.transpose(1, 2) * scale  # [num_heads, q_len, seq_len]
        query_pos = seq_len - (end - start) + torch.arange(end - start, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] > query_pos[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
        out[start:end] = (scores.softmax(dim=-1) @ v).transpose(0, 1)
    return out
