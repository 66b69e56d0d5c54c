"""A Llama GGUF's Q4_1 linear weights as they are in the file, for ``--quantization q4``.

The gguf package reads the file (memory-mapped); each Q4_1 tensor is ``[out, in / 32]``
blocks of 20 bytes (float16 ``d``, float16 ``m``, 16 bytes holding 32 4-bit values: byte
``j``'s low nibble is value ``j``, its high nibble value ``j + 16``; ggml's ``block_q4_1``).
llama.cpp's converter permutes the rows of q and k for its rotary layout; they are permuted
back here as transformers' GGUF loader does for the weights it de-quantizes, so the blocks
line up with the model's heads (:func:`unpermute_rows`). The result is keyed by our fused
layers: ``layers.{i}.qkv_proj`` (q, k, v rows), ``o_proj``, ``gate_up_proj`` (gate, up) and
``down_proj``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from iterserve.kernels.quantized_linear import Q4_1_BLOCK_BYTES, Q4_GROUP, Q4Weight

# Our fused layer -> its GGUF tensors (``blk.{i}.<name>.weight``), rows in this order.
FUSED_Q4_LAYERS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}


class NotQ4Error(ValueError):
    """The file is no GGUF whose linear weights are all Q4_1."""


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py's ``permute``): per head,
    rows ``[h, 2, dim]`` back to ``[h, dim, 2]`` order (``dim`` = head rows / 2). Rows carry
    whole blocks, so this moves the Q4_1 blocks and changes no value."""
    out_rows = rows.shape[0]
    dim = out_rows // num_heads // 2
    return rows.reshape(num_heads, dim, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def decode_q4_1(blocks: np.ndarray, in_features: int) -> Q4Weight:
    """``[out, in / 32 * 20]`` uint8 Q4_1 blocks -> :class:`Q4Weight`."""
    out = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(out, in_features // Q4_GROUP, Q4_1_BLOCK_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = b[..., 4:]  # [out, blocks, 16]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(out, in_features)
    return Q4Weight(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))


def read_q4_linears(gguf_path: Path, hf_config: Any) -> dict[str, Q4Weight]:
    """Every decoder layer's linear weights from ``gguf_path``, fused as our model holds them.

    Args:
        gguf_path: a Llama-family GGUF file.
        hf_config: its Hugging Face config (``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads``).

    Returns:
        ``{"layers.{i}.qkv_proj": Q4Weight, ...}`` for every layer, each weight
        ``[out_features, in_features]``.

    Raises:
        NotQ4Error: a linear weight is missing or not Q4_1.
    """
    from gguf import GGMLQuantizationType, GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    heads = {
        "attn_q": int(hf_config.num_attention_heads),
        "attn_k": int(hf_config.num_key_value_heads),
    }
    weights: dict[str, Q4Weight] = {}
    for layer in range(int(hf_config.num_hidden_layers)):
        for ours, names in FUSED_Q4_LAYERS.items():
            parts = []
            for name in names:
                tensor = tensors.get(f"blk.{layer}.{name}.weight")
                if tensor is None or tensor.tensor_type != GGMLQuantizationType.Q4_1:
                    kind = "missing" if tensor is None else tensor.tensor_type.name
                    raise NotQ4Error(
                        f"{gguf_path.name}: blk.{layer}.{name}.weight is {kind}, not Q4_1"
                    )
                blocks = np.asarray(tensor.data)
                if name in heads:
                    blocks = unpermute_rows(blocks, heads[name])
                parts.append(decode_q4_1(blocks, int(tensor.shape[0])))
            weights[f"layers.{layer}.{ours}"] = Q4Weight.concat(parts)
    return weights
