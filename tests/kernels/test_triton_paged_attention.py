"""The Triton ragged paged-attention kernel against its torch reference computed in float64,
on random inputs (under Triton's interpreter without a GPU: tests/conftest.py sets
``TRITON_INTERPRET=1``). The interpreter computes with numpy, which has no bfloat16: bfloat16
runs only on a GPU (``python -m benchmarks.gpu`` runs these cases there, in bfloat16 too). The cases
and the comparison live in :mod:`iterserve.kernels.triton_checks`. Shapes stay tiny because the
interpreter runs every program in Python."""

from __future__ import annotations

import pytest
import torch

from iterserve.kernels.triton_checks import (
    ATTENTION_CASES,
    AttentionCase,
    check_paged_attention,
    gpu_attention_cases,
    make_batch,
)
from iterserve.kernels.triton_paged_attention import default_num_splits, paged_attention


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.name)
def test_matches_float64_reference(case: AttentionCase) -> None:
    check_paged_attention(case)


def test_bfloat16_cases_are_added_for_gpus() -> None:
    cases = gpu_attention_cases()
    assert len(cases) == 2 * len(ATTENTION_CASES)
    assert {c.dtype for c in cases[len(ATTENTION_CASES) :]} == {torch.bfloat16}


def test_default_num_splits() -> None:
    # Many (request, KV head) programs or short contexts: no split; one long decode: 16.
    assert default_num_splits(64, 8, 8192) == 1
    assert default_num_splits(2, 8, 300) == 1
    assert default_num_splits(1, 8, 2048) == 4
    assert default_num_splits(1, 1, 1 << 20) == 16


def test_rejects_bad_inputs() -> None:
    batch = make_batch([(2, 5)], 1, 2, 16, 64, torch.float32)
    args = dict(max_query_len=2, max_seq_len=5, scale=0.125)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        paged_attention(**{**batch, "q": batch["q"].double()}, **args)
    with pytest.raises(ValueError, match="caches must be"):
        paged_attention(**{**batch, "key_cache": batch["key_cache"].half()}, **args)
    with pytest.raises(ValueError, match="block_size must be"):
        small_blocks = {k: batch[k].view(1, -1, 8, 64) for k in ("key_cache", "value_cache")}
        paged_attention(**{**batch, **small_blocks}, **args)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(**{**batch, "q": torch.zeros(2, 2, 32)}, **args)
    with pytest.raises(ValueError, match="seq_lens must be int64"):
        paged_attention(**{**batch, "seq_lens": batch["seq_lens"].int()}, **args)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(**batch, **args, num_splits=3)
