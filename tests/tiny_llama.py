"""A tiny random Llama (4 query heads, 2 KV heads) for executor tests that need a real forward."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from iterserve.kernels.platform import Platform
from iterserve.models.llama import LlamaForCausalLM


def tiny_model(
    platform: Platform, hidden_size: int = 32, num_layers: int = 2, max_position: int = 64
) -> LlamaForCausalLM:
    """Random weights (seed 0, scale 0.2), float32, on the CPU; head_dim ``hidden_size // 4``."""
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=hidden_size,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config, max_position, platform)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.pack_linear_weights()
    return model.eval()
