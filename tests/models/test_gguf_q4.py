"""The GGUF's own Q4_1 weights: read without de-quantizing, q and k rows permuted back, they
are exactly the weights the converted model holds; a file that is not Q4_1 is refused."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from iterserve.models.gguf_q4 import NotQ4Error, read_q4_linears
from iterserve.models.loader import default_gguf_path, resolve_model_dir

PARTS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


@pytest.mark.model
def test_the_default_files_blocks_are_the_converted_weights_exactly() -> None:
    from iterserve.executor.weights import load_hf_config

    model_dir = resolve_model_dir("default")
    weights = read_q4_linears(default_gguf_path(), load_hf_config(model_dir))
    assert len(weights) == 30 * 4
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for layer in (0, 29):
            for ours, theirs in PARTS.items():
                q4 = weights[f"layers.{layer}.{ours}"]
                assert q4.q.dtype == torch.uint8 and int(q4.q.max()) <= 15
                hf = torch.cat([f.get_tensor(f"model.layers.{layer}.{n}.weight") for n in theirs])
                assert torch.equal(q4.dequantize(), hf.float()), (layer, ours)


def test_a_file_whose_linears_are_not_q4_1_is_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "f32.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(NotQ4Error, match=r"blk\.0\.attn_q\.weight is F32, not Q4_1"):
        read_q4_linears(path, config)
