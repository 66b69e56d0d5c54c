"""Config invariants are checked when a config is built; flags derive from the fields."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from iterserve.cli import build_parser, engine_kwargs
from iterserve.config import (
    MAX_TIERS,
    ConfigError,
    EngineConfig,
    parse_tiers,
)


def test_defaults() -> None:
    cfg = EngineConfig.from_kwargs()
    assert cfg.model.model == "default"
    assert cfg.model.dtype == "auto"
    assert cfg.cache.block_size == 16
    assert cfg.cache.enable_prefix_caching
    assert cfg.scheduler.enable_chunked_prefill
    assert cfg.scheduler.kv_watermark == 0.01


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "must be >= max_num_seqs"),
        ({"long_prefill_token_threshold": 4096}, "long_prefill_token_threshold"),
        ({"kv_watermark": 1.0}, "kv_watermark"),
        ({"block_size": 12}, "block_size"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"num_kv_blocks": 8, "kv_cache_memory": 1 << 20}, "at most one"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        (
            {"enable_chunked_prefill": False, "max_model_len": 2048},
            "must be >= max_model_len",
        ),
    ],
)
def test_invalid_configs_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineConfig.from_kwargs(max_num_seq=4)


def test_flags_and_yaml_config(tmp_path: Path) -> None:
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("max-num-seqs: 8\nmax_num_batched_tokens: 256\ndtype: float32\n")
    parser = build_parser()
    args = parser.parse_args(
        [
            "generate",
            "--config",
            str(config_file),
            "--max-num-seqs",
            "4",
            "--no-enable-prefix-caching",
        ]
    )
    kwargs = engine_kwargs(args, parser)
    assert kwargs == {
        "max_num_seqs": 4,  # the flag beats the file
        "max_num_batched_tokens": 256,
        "dtype": "float32",
        "enable_prefix_caching": False,
    }
    cfg = EngineConfig.from_kwargs(**kwargs)
    assert cfg.scheduler.max_num_seqs == 4
    assert not cfg.cache.enable_prefix_caching


def test_enforce_eager_flag_and_keyword() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "--enforce-eager"])
    kwargs = engine_kwargs(args, parser)
    assert kwargs == {"enforce_eager": True}
    assert EngineConfig.from_kwargs(**kwargs).model.enforce_eager
    assert not EngineConfig.from_kwargs().model.enforce_eager  # graphs on by default (CUDA)


def test_yaml_config_unknown_key_is_an_error(tmp_path: Path) -> None:
    config_file = tmp_path / "bad.yaml"
    config_file.write_text("max-num-sequences: 8\n")
    parser = build_parser()
    args = parser.parse_args(["generate", "--config", str(config_file)])
    with pytest.raises(SystemExit):
        engine_kwargs(args, parser)


def test_tiers_are_bounded() -> None:
    many = [{"name": f"t{i}", "priority": i} for i in range(MAX_TIERS + 1)]
    assert len(parse_tiers(many[:MAX_TIERS])) == MAX_TIERS
    with pytest.raises(ConfigError, match=f"at most {MAX_TIERS} tiers"):
        parse_tiers(many)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "a"}, "priority required"),
        ({"priority": 1}, "name required"),
        ({"name": "a", "priority": 1, "x": 2}, "unknown keys ['x']"),
    ],
)
def test_a_bad_tier_says_what_is_wrong_in_its_own_words(
    entry: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        parse_tiers([entry])
    assert "__init__" not in str(e.value)
