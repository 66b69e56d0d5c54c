"""The default rotary frequencies (computed here, not imported from transformers' Llama module,
whose import cost every engine start a second) equal transformers' own."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from iterserve.models.llama import build_rotary


@pytest.mark.parametrize(
    ("hidden", "heads", "theta"), [(576, 9, 100000.0), (4096, 32, 500000.0), (64, 4, 10000.0)]
)
def test_default_frequencies_equal_transformers(hidden: int, heads: int, theta: float) -> None:
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, rope_theta=theta)
    ours = build_rotary(config, hidden // heads, max_position=64)
    inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    positions = torch.arange(64, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    assert torch.equal(ours.cos, emb.cos() * scaling)
    assert torch.equal(ours.sin, emb.sin() * scaling)
