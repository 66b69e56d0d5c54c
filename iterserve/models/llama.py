"""Llama-family decoder (Llama 2/3, SmolLM2, ...) over a flattened ragged batch.

Prefill chunks and decode tokens of many requests run in one forward as ``[num_tokens,
hidden]``: no padding to the longest sequence. Attention over the paged KV cache is done by
an :class:`Attention` object the executor passes in (it knows the block tables and the slot
mapping); this module knows nothing of pages. The norms, SwiGLU's activation, rotary and the
packed linears run by the :class:`~iterserve.kernels.platform.Platform` the model is built
with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.kernels.platform import LinearOp, Platform, Rotate
from iterserve.kernels.quantized_linear import QuantizedRows, silu_and_mul_quantize
from iterserve.models.layers import (
    MergedColumnParallelLinear,
    PackableLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_vocab_rows,
    materialize,
)
from iterserve.models.parallel import SINGLE, TPGroup, kv_head_range


class Attention(Protocol):
    """Paged attention of one iteration, bound to its metadata and the KV cache."""

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write k, v to the cache and attend.

        Args:
            q: [num_tokens, num_heads, head_dim]
            k, v: [num_tokens, num_kv_heads, head_dim]
        Returns:
            [num_tokens, num_heads, head_dim]
        """
        ...


def build_rotary(config: Any, head_dim: int, max_position: int) -> RotaryEmbedding:
    """Rotary embedding from the config's ``rope_parameters``: RoFormer's frequencies for the
    default type, transformers' rope functions for the others (linear, yarn, llama3, ...).

    Raises:
        ValueError: for rope types whose frequencies change at run time (dynamic, longrope).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (frequencies vary at run time)")
    if rope_type == "default":
        # RoFormer's frequencies (Su et al., 2021): theta^(-2i/d), unscaled. transformers keeps
        # them in each model's module, whose import cost every engine start a second.
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return RotaryEmbedding(inv_freq, 1.0, max_position)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return RotaryEmbedding(inv_freq, float(scaling), max_position)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, platform: Platform, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.platform = platform
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        attn_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, platform)
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, num_heads, config.num_key_value_heads, bias=attn_bias, tp=tp
        )
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=attn_bias, tp=tp)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, platform)
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=mlp_bias, tp=tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias=mlp_bias, tp=tp)
        # This rank's heads (all of them with one rank).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotate: Rotate,
        attention: Attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer, with the residual add deferred to the next norm (fused there).

        Args:
            x: [num_tokens, hidden], the previous layer's MLP output (the embeddings first).
            residual: [num_tokens, hidden], the residual stream before ``x`` is added; None
                in the first layer.

        Returns:
            ``(mlp_output, residual)``: the caller adds them (the next layer's norm does).
        """
        num_tokens = x.shape[0]
        h, residual = self._norm_into(self.input_layernorm, self.qkv_proj, x, residual)
        qkv = self.qkv_proj(h)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rotate(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
        )
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        o = attention(self.layer_idx, q, k, v)  # [num_tokens, num_heads, head_dim]
        attn_out = self.o_proj(o.reshape(num_tokens, self.q_size))
        h, residual = self._norm_into(
            self.post_attention_layernorm, self.gate_up_proj, attn_out, residual
        )
        return self._mlp(h, num_tokens), residual

    @staticmethod
    def _norm_into(
        norm: RMSNorm, linear: PackableLinear, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` (``(norm(x), x)`` without a residual) as
        ``linear`` takes it: where it runs int8 at these rows, quantized in the norm's own
        pass (one pass over the rows fewer, the same bytes)."""
        op = linear.int8_op(x.shape[0])
        if op is not None:
            return norm.forward_quantized(x, residual, op.smooth)
        if residual is None:
            return norm(x), x
        return norm.forward_residual(x, residual)

    def _mlp(self, h: torch.Tensor | QuantizedRows, num_tokens: int) -> torch.Tensor:
        """SwiGLU: ``down(silu(gate) * up)``. Where gate_up and down both run int8 at these
        rows, gate_up's GEMM output goes through SiLU-and-multiply into down's quantized input
        in one pass (:func:`~iterserve.kernels.quantized_linear.silu_and_mul_quantize`)."""
        gate_up_op = self.gate_up_proj.int8_op(num_tokens)
        down_op = self.down_proj.int8_op(num_tokens)
        if gate_up_op is not None and down_op is not None and self.gate_up_proj.bias is None:
            acc, scale = gate_up_op.accumulate(h)
            return self.down_proj(silu_and_mul_quantize(acc, scale, down_op.smooth))
        gate_up = self.gate_up_proj(h)  # [num_tokens, 2 * intermediate]
        return self.down_proj(self.platform.silu_and_mul(gate_up))


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus the language-model head (tied to the embeddings when the config
    says so), as one tensor-parallel shard.

    Args:
        config: the Hugging Face model config.
        max_position: positions the rotary tables cover (the serving ``max_model_len``).
        platform: runs the norms, SwiGLU's activation, rotary and packed linears
            (:func:`~iterserve.kernels.platform.select_platform`, chosen once at start).
        tp: the tensor-parallel group this shard belongs to (one rank: the whole model).

    Raises:
        ValueError: the heads or the MLP width do not divide by ``tp.size``.
    """

    def __init__(
        self, config: Any, max_position: int, platform: Platform, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.config = config
        self.platform = platform
        self.tp = tp
        self.vocab_size = int(config.vocab_size)
        self.embed_tokens = VocabParallelEmbedding(self.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, platform, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, platform)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:  # this rank's rows of the vocabulary
            per_rank = self.embed_tokens.per_rank
            self.lm_head = nn.Parameter(torch.zeros(per_rank, config.hidden_size))
        self.num_kv_heads = kv_head_range(int(config.num_key_value_heads), tp)[1]  # this rank's
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.rotary = build_rotary(config, self.head_dim, max_position)
        self.packed_lm_head: LinearOp | None = None
        # What --quantization chose (iterserve.executor.quantization.QuantizationPlan).
        self.quantization_plan: Any = None
        self._weight_bytes: int | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        rotate = self.platform.rotary(positions, *self.rotary.tables(x.dtype))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rotate, attention)
        assert residual is not None, "a model without layers"
        return self.norm.forward_residual(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_sampled, hidden] -> logits [num_sampled, vocab_size] in the model's dtype (the
        sampler makes a float32 copy only when it needs one). With tensor parallelism each
        rank computes its vocabulary columns and the driver gathers them; the other ranks get
        None."""
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden, None)
        else:
            logits = F.linear(hidden, self.lm_head_weight)
        if self.tp.size == 1:
            return logits
        gathered = self.tp.gather_to_driver(logits)  # [num_sampled, size * per_rank]
        return gathered[:, : self.vocab_size] if gathered is not None else None

    def pack_linear_weights(self) -> None:
        """Repack every linear weight where the platform packs weights (oneDNN's layout in
        bfloat16 on CPUs), the LM head as a copy when it is tied to the embeddings; a no-op
        elsewhere. After loading and the dtype cast, once."""
        weight_bytes = self.weight_bytes()
        packed_lm_head = self.platform.pack_linear_weight(self.lm_head_weight)
        if packed_lm_head is None:
            return
        self._weight_bytes = weight_bytes
        for module in self.modules():
            if isinstance(module, PackableLinear):
                module.pack_weight(self.platform)
        self.packed_lm_head = packed_lm_head

    def linear_layers(self) -> list[tuple[str, PackableLinear]]:
        """The decoder's linear layers by name (``layers.{i}.qkv_proj``, ...), in forward order."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, PackableLinear)]

    def install_linear_ops(self, ops: Mapping[str, LinearOp], lm_head: LinearOp) -> None:
        """Run each linear layer named in ``ops`` (:meth:`linear_layers`' names) and the LM head
        by the given ops (quantized copies of their weights), freeing the plain weights; once,
        after loading, instead of :meth:`pack_linear_weights`."""
        self._weight_bytes = self.weight_bytes()
        modules = dict(self.linear_layers())
        for name, op in ops.items():
            modules[name].use_op(op)
        self.packed_lm_head = lm_head

    def weight_bytes(self) -> int:
        """Bytes of the model's weights as loaded (tied embeddings once; packing copies not
        counted): what one forward reads at least."""
        if self._weight_bytes is not None:
            return self._weight_bytes
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load Hugging Face Llama checkpoint tensors, fusing q/k/v and gate/up, each cut to
        this rank's shard. A weight may be a tensor or a lazy safetensors slice
        (``safe_open(...).get_slice(name)``), of which only the shard is read.

        Raises:
            ValueError: a checkpoint tensor has no place in this model, or a parameter was
                never loaded.
        """
        fused = {
            "q_proj": ("qkv_proj", "q"),
            "k_proj": ("qkv_proj", "k"),
            "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", "0"),
            "up_proj": ("gate_up_proj", "1"),
        }
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            name = name.replace("self_attn.", "").replace("mlp.", "")
            if name == "lm_head.weight":
                if self.tie_word_embeddings:
                    continue
                name = "lm_head"
            if "rotary_emb" in name:
                continue
            shard_id = None
            for hf_part, (ours, shard) in fused.items():
                if f".{hf_part}." in name:
                    name, shard_id = name.replace(hf_part, ours), shard
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no parameter in the model")
            param = params[name]
            module = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
            loader = getattr(module, "weight_loader", None)
            with torch.no_grad():  # copy_ casts to the parameter's dtype
                if loader is not None:
                    loader(param, tensor, shard_id)
                elif name == "lm_head":
                    load_vocab_rows(param, tensor, self.embed_tokens.vocab_start, self.vocab_size)
                else:
                    param.data.copy_(materialize(tensor))
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"parameters missing from the checkpoint: {sorted(missing)[:5]}")
