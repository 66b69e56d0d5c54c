"""Weight loading: the Hugging Face config (supported architectures, context length, the
degrees its shapes split into), EOS ids, and the model filled from lazy safetensors slices."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from iterserve.config import ConfigError, EngineConfig
from iterserve.kernels.platform import Platform
from iterserve.models.llama import LlamaForCausalLM
from iterserve.models.parallel import SINGLE, TPGroup, divide, kv_head_range

_SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM"}


def load_hf_config(model_dir: Path) -> Any:
    """The Hugging Face config of ``model_dir``.

    Raises:
        ConfigError: a ``config.json`` transformers cannot read (no ``model_type``, not JSON),
            or an architecture this server does not run.
    """
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, OSError, KeyError) as e:  # transformers' words for a bad config.json
        raise ConfigError(f"{model_dir}: config.json is no model config: {e}") from e
    archs = set(getattr(hf_config, "architectures", None) or [])
    if not archs & _SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{model_dir}: architectures {sorted(archs)} are not supported "
            f"(supported: {sorted(_SUPPORTED_ARCHITECTURES)})"
        )
    return hf_config


# Positions are exact in the float32 rotary tables up to 2^24; the tables hold max_model_len rows.
MAX_POSITIONS = 1 << 24


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    """``--max-model-len``, else the model's context length (``max_position_embeddings``).

    Raises:
        ConfigError: more than the model's maximum, or more than :data:`MAX_POSITIONS` (a
            model file claiming 2^31 positions asked for terabytes of rotary tables).
    """
    model_max = int(hf_config.max_position_embeddings)
    asked = config.model.max_model_len
    if asked is not None and asked > model_max:
        raise ConfigError(f"max_model_len {asked} exceeds the model's maximum {model_max}")
    resolved = asked or model_max
    if resolved > MAX_POSITIONS:
        raise ConfigError(
            f"max_model_len {resolved:,} (the model's context length) is beyond the "
            f"{MAX_POSITIONS:,} positions the rotary tables hold exactly: pass --max-model-len"
        )
    return resolved


def load_tokenizer(model_dir: Path) -> Any:
    """The directory's Hugging Face tokenizer.

    Raises:
        ConfigError: none there, or one transformers cannot build.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (ValueError, OSError) as e:
        raise ConfigError(f"{model_dir}: no tokenizer transformers can load: {e}") from e


def eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config, the model config and the tokenizer, combined."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    sources: list[Any] = [hf_config.eos_token_id, tokenizer.eos_token_id]
    if (model_dir / "generation_config.json").is_file():
        sources.append(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id)
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return frozenset(ids)


def load_model(
    hf_config: Any,
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    platform: Platform,
    tp: TPGroup = SINGLE,
    quantization: str = "none",
    gguf: Path | None = None,
) -> LlamaForCausalLM:
    """Instantiate our Llama forward (rank ``tp.rank``'s shard) on ``platform``, fill it from
    the directory's safetensors files, and pack its linear weights where the platform packs
    them, or put them on ``quantization``'s kernels (:mod:`~iterserve.executor.quantization`;
    ``gguf``: the file whose Q4_1 weights ``q4`` serves). Each tensor is opened as a lazy
    slice and only this rank's shard of it is read.

    Raises:
        ConfigError: no safetensors files, heads that do not divide by ``tp.size``, weights
            that do not fit the model, or a ``q4`` file whose linear weights are not Q4_1.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no .safetensors weights")
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config, max_position, platform, tp)
    except ValueError as e:  # a degree the heads or the MLP width do not divide by
        raise ConfigError(str(e)) from e

    from safetensors import SafetensorError

    try:
        model.load_weights(checkpoint_slices(files))
    except (ValueError, SafetensorError) as e:  # no place, never loaded, a cut-off file
        raise ConfigError(f"{model_dir}: {e}") from e
    # Rotary tables are computed in float32 and cast here, as Hugging Face casts cos/sin.
    model = model.to(dtype).eval()
    if quantization == "none":
        model.pack_linear_weights()
    else:
        from iterserve.executor.quantization import quantize_linears

        model.quantization_plan = quantize_linears(model, quantization, model_dir, gguf, hf_config)
    return model


def checkpoint_slices(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """``(name, lazy slice)`` of every tensor in the safetensors ``files``: nothing is read until
    a weight loader indexes the slice, and then only the indexed part (memory-mapped)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_slice(name)


def check_tensor_parallel(hf_config: Any, size: int) -> None:
    """Refuse a degree the model's shapes do not split into, before any process starts.

    Raises:
        ConfigError: the query heads, the MLP width or (for the KV heads) neither the degree
            nor the KV head count divides the other; or CUDA has fewer GPUs than ranks.
    """
    if size == 1:
        return
    kv = int(hf_config.num_key_value_heads)
    try:
        divide(int(hf_config.num_attention_heads), size, "num_attention_heads")
        divide(int(hf_config.intermediate_size), size, "intermediate_size")
        kv_head_range(kv, TPGroup(0, size))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if torch.cuda.is_available() and torch.cuda.device_count() < size:
        raise ConfigError(
            f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} visible"
        )
