"""Model files: the cached GGUF conversion, plain Hugging Face directories, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from iterserve.config import EngineConfig
from iterserve.models import loader
from iterserve.models.loader import ModelNotFoundError, default_gguf_path, resolve_model_dir


@pytest.mark.model
def test_default_model_converts_to_a_plain_hf_directory(loaded_f32: Any) -> None:
    model_dir = loaded_f32.model_dir
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert loaded_f32.eos_token_ids == frozenset({2})
    assert loaded_f32.tokenizer.chat_template  # the chat template travels with the model


@pytest.mark.model
def test_cached_conversion_is_reused(loaded_f32: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_convert(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "_write_hf_dir", must_not_convert)
    assert resolve_model_dir("default") == loaded_f32.model_dir
    assert resolve_model_dir(str(default_gguf_path())) == loaded_f32.model_dir


@pytest.mark.model
def test_concurrent_starts_convert_once(tmp_path: Path) -> None:
    """Two processes converting into an empty cache at once: one directory, nothing half-written."""
    code = (
        "from iterserve.models.loader import resolve_model_dir; print(resolve_model_dir('default'))"
    )
    env = {**os.environ, "ITERSERVE_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1
    entries = sorted(
        p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")
    )
    assert entries == [Path(paths.pop()).name]  # no temporary directory left behind


@pytest.mark.model
def test_local_hf_directory_loads_the_same_way(loaded_f32: Any) -> None:
    from iterserve.executor.build import build

    other = build(
        EngineConfig.from_kwargs(model=str(loaded_f32.model_dir), dtype="float32", num_kv_blocks=4)
    )
    assert other.model_dir == loaded_f32.model_dir
    a = dict(other.runner.model.named_parameters())
    b = dict(loaded_f32.runner.model.named_parameters())
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve_model_dir(str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")
