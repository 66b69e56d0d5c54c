"""Model files: the cached GGUF conversion, plain Hugging Face directories, clear errors."""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iterserve import envs
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
def test_a_link_to_a_gguf_is_its_file(
    loaded_f32: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symlinked GGUF (a volume's alias) is cached under its file's name: converted once."""

    def must_not_convert(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "_write_hf_dir", must_not_convert)
    link = tmp_path / "alias.gguf"
    link.symlink_to(default_gguf_path())
    assert resolve_model_dir(str(link)) == loaded_f32.model_dir


def test_concurrent_starts_convert_once(tmp_path: Path) -> None:
    """Two processes converting into an empty cache at once: one directory, nothing half-written
    (a tiny GGUF: the lock and the rename are what is tested, not the model's size)."""
    gguf = _complete_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    code = (
        "from iterserve.models.loader import resolve_model_dir; "
        f"print(resolve_model_dir({str(gguf)!r}))"
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
    with pytest.raises(ModelNotFoundError, match=r"holds no config\.json and no \.gguf file"):
        resolve_model_dir(str(tmp_path))  # an empty directory
    with pytest.raises(ModelNotFoundError, match="the model is empty"):
        resolve_model_dir("")  # served the current directory


def _gguf(path: Path, arch: str, keys: dict[str, int], blocks: int, width: int = 16) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in keys.items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, width), dtype=np.float32))
    for i in range(blocks):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(width, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA_KEYS = {
    "llama.block_count": 2,
    "llama.embedding_length": 16,
    "llama.feed_forward_length": 32,
    "llama.attention.head_count": 2,
}


@pytest.mark.parametrize(
    ("arch", "keys", "blocks", "error"),
    [
        ("gpt2", LLAMA_KEYS, 2, "general.architecture is 'gpt2'"),
        ("llama", {}, 2, "no llama.block_count, llama.embedding_length"),
        ("llama", LLAMA_KEYS, 1, "declares 2 layers and holds 1"),
        ("llama", {**LLAMA_KEYS, "llama.embedding_length": 4096}, 2, "tensors hold 64 "),
        ("llama", {**LLAMA_KEYS, "llama.feed_forward_length": 1 << 30}, 2, "describes"),
        ("llama", {**LLAMA_KEYS, "llama.attention.head_count": 0}, 2, "no positive attention"),
        ("llama", {**LLAMA_KEYS, "llama.attention.head_count": 7}, 2, "7 heads do not divide"),
        ("llama", {**LLAMA_KEYS, "llama.attention.head_count_kv": 0}, 2, "head_count_kv is 0"),
        ("llama", {**LLAMA_KEYS, "llama.rope.freq_base": -1.0}, 2, "freq_base is -1.0"),
    ],
    ids=[
        "architecture",
        "metadata",
        "layers",
        "width",
        "ffn",
        "heads",
        "odd-heads",
        "kv-heads",
        "rope",
    ],
)
def test_a_gguf_it_cannot_serve_is_refused_from_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, keys: dict, blocks: int, error: str
) -> None:
    """Refused before transformers reads it: without its metadata transformers builds its
    config class's defaults (a 7B Llama: 24 GB, then the kernel's OOM killer), measured."""
    monkeypatch.setattr(envs, "ITERSERVE_CACHE_DIR", str(tmp_path / "cache"))  # read at import
    path = _gguf(tmp_path / "model.gguf", arch, keys, blocks)
    with pytest.raises(ModelNotFoundError, match=error):
        resolve_model_dir(str(path))
    assert not (tmp_path / "cache" / "models").exists()  # nothing converted, nothing cached


def _complete_gguf(path: Path, leave_out: str = "", tokenizer: bool = False) -> Path:
    """A whole two-layer Llama GGUF (width 16, zeros), less the tensor ``leave_out``; with
    ``tokenizer``, a byte-pair tokenizer of 4 tokens too, so that transformers converts it (in
    seconds, where the default model takes half a minute)."""
    import gguf

    width, ffn = 16, 32
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in LLAMA_KEYS.items():
        writer.add_uint32(key, value)
    tokens = ["a", "b", "ab", "<eos>"] if tokenizer else ["a", "b"]
    writer.add_token_list(tokens)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_merges(["a b"])
        writer.add_token_types([1, 1, 1, 3])
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_eos_token_id(len(tokens) - 1)
    vocab = len(tokens)
    shapes = {"token_embd.weight": (vocab, width), "output_norm.weight": (width,)}
    for i in range(LLAMA_KEYS["llama.block_count"]):
        for name in ("attn_norm", "ffn_norm"):
            shapes[f"blk.{i}.{name}.weight"] = (width,)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            shapes[f"blk.{i}.{name}.weight"] = (width, width)
        for name, shape in (("ffn_gate", (ffn, width)), ("ffn_up", (ffn, width))):
            shapes[f"blk.{i}.{name}.weight"] = shape
        shapes[f"blk.{i}.ffn_down.weight"] = (width, ffn)
    for name, shape in shapes.items():
        if name != leave_out:
            writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_missing_a_weight_is_refused(tmp_path: Path) -> None:
    """transformers converts it, filling the weight with its random initialisation (served as
    the model's before): refused by name, nothing converted."""
    loader.check_gguf(_complete_gguf(tmp_path / "whole.gguf"))
    path = _complete_gguf(tmp_path / "model.gguf", leave_out="blk.1.ffn_norm.weight")
    with pytest.raises(ModelNotFoundError, match=r"model\.gguf holds no blk\.1\.ffn_norm\.weight"):
        loader.check_gguf(path)


def test_a_truncated_gguf_is_refused_as_cut_off(tmp_path: Path) -> None:
    """A partial download: its header whole, its tensors' bytes short (transformers' reshape
    error named neither the file nor the cause)."""
    path = _complete_gguf(tmp_path / "model.gguf")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelNotFoundError, match=r"model\.gguf is cut off: 1 of its 20 tensors"):
        loader.check_gguf(path)


def test_a_converted_model_is_readable_as_the_umask_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared cache's model is readable by its other users (the temporary directory was
    mkdtemp's 0700, and the rename kept it)."""
    monkeypatch.setattr(envs, "ITERSERVE_CACHE_DIR", str(tmp_path / "cache"))  # read at import

    def write(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        weights = out / "model.safetensors"  # as safetensors' save_file leaves it
        weights.write_bytes(b"weights")
        weights.chmod(0o600)

    monkeypatch.setattr(loader, "_write_hf_dir", write)
    old = os.umask(0o022)
    try:
        target = loader.convert_gguf(_complete_gguf(tmp_path / "model.gguf"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE((target / name).stat().st_mode) == 0o644


def test_a_full_cache_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envs, "ITERSERVE_CACHE_DIR", str(tmp_path / "cache"))  # read at import

    def write(gguf: Path, out: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loader, "_write_hf_dir", write)
    with pytest.raises(ModelNotFoundError, match=r"model\.gguf cannot be converted into .*"
                       r"No space left on device"):  # fmt: skip
        loader.convert_gguf(_complete_gguf(tmp_path / "model.gguf"))
    assert not [p for p in loader.cache_root().iterdir() if p.is_dir()]


def _tensor_info_at(data: bytes, tensor: str) -> int:
    """The byte where ``tensor``'s info continues after its name: n_dims, dims, type, offset."""
    name = tensor.encode()
    return data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)


def test_tensors_off_the_alignment_or_overlapping_are_refused(tmp_path: Path) -> None:
    """Each would convert and serve another tensor's bytes (llama.cpp refuses both)."""
    whole = _complete_gguf(tmp_path / "whole.gguf").read_bytes()
    at = _tensor_info_at(whole, "blk.0.ffn_down.weight")
    offset_at = at + 4 + 8 * struct.unpack_from("<I", whole, at)[0] + 4
    offset = struct.unpack_from("<Q", whole, offset_at)[0]
    cases = [(offset + 1, "not a multiple of the file's alignment 32"), (0, "bytes overlap")]
    for new_offset, error in cases:
        data = bytearray(whole)
        struct.pack_into("<Q", data, offset_at, new_offset)
        path = tmp_path / "model.gguf"
        path.write_bytes(bytes(data))
        with pytest.raises(ModelNotFoundError, match=error):
            loader.check_gguf(path)


def test_an_alignment_no_power_of_two_or_past_the_file_is_refused(tmp_path: Path) -> None:
    import gguf

    for alignment, error in ((48, "general.alignment 48 is not a power of two"),
                             (1 << 30, "would start at byte 1,073,741,824")):  # fmt: skip
        path = tmp_path / f"a{alignment}.gguf"
        writer = gguf.GGUFWriter(str(path), arch="llama")
        writer.add_uint32("general.alignment", alignment)
        for key, value in LLAMA_KEYS.items():
            writer.add_uint32(key, value)
        writer.add_tensor("token_embd.weight", np.zeros((2, 16), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        with pytest.raises(ModelNotFoundError, match=error):
            loader.check_gguf(path)


def test_a_killed_conversions_leftovers_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversion killed half-way leaves its temporary directory: the next one (holding the
    lock, so no other is running) removes it."""
    monkeypatch.setattr(envs, "ITERSERVE_CACHE_DIR", str(tmp_path / "cache"))  # read at import
    path = _complete_gguf(tmp_path / "model.gguf")
    root = loader.cache_root()
    target_name = f"model-{loader._sha256(path)[:16]}"
    stale = root / f"{target_name}.tmp-killed"
    (stale / "half").mkdir(parents=True)
    other = root / "another-model.tmp-running"
    other.mkdir()
    monkeypatch.setattr(
        loader, "_write_hf_dir", lambda gguf, out: (out / "config.json").write_text("{}")
    )
    assert loader.convert_gguf(path) == root / target_name
    assert not stale.exists()
    assert other.exists()  # another model's conversion is not ours to judge


def test_a_file_that_is_no_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFoundError, match="not a readable GGUF"):
        loader.check_gguf(path)


def test_the_default_gguf_passes_the_check() -> None:
    loader.check_gguf(default_gguf_path())


def test_a_directory_holding_one_gguf_is_that_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the operator mounts a volume holding a llama.cpp model (--model /models): served as
    the file (q4 reads its blocks); two .gguf files are a clear error, not a guess."""
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "model.gguf").symlink_to(default_gguf_path())
    assert loader.source_gguf(str(volume)) == volume / "model.gguf"
    converted = tmp_path / "converted"
    monkeypatch.setattr(loader, "convert_gguf", lambda path: converted if path.exists() else None)
    assert resolve_model_dir(str(volume)) == converted
    (volume / "other.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"holds 2 \.gguf files"):
        resolve_model_dir(str(volume))
    (volume / "config.json").write_text("{}")  # a Hugging Face directory: its own weights
    assert loader.source_gguf(str(volume)) is None


def test_metadata_that_is_no_whole_number_is_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_string("llama.block_count", "thirty")
    for key in ("embedding_length", "feed_forward_length", "attention.head_count"):
        writer.add_uint32(f"llama.{key}", 16)
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFoundError, match="block_count is 'thirty', not a whole number"):
        loader.check_gguf(path)


def test_a_count_the_file_cannot_hold_is_refused_before_the_reader(tmp_path: Path) -> None:
    """84 bytes claiming an array of 2^40 values: the gguf package's reader built it value by
    value (24 GB, then the OOM killer, measured); the header walk refuses it at once."""
    import struct

    def text(value: bytes) -> bytes:
        return struct.pack("<Q", len(value)) + value

    path = tmp_path / "a.gguf"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + text(b"general.architecture")
    path.write_bytes(header + struct.pack("<IIQ", 9, 0, 2**40) + bytes(16))
    with pytest.raises(ModelNotFoundError, match="array length of 1,099,511,627,776"):
        loader.check_gguf(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2**50))
    with pytest.raises(ModelNotFoundError, match="key count"):
        loader.check_gguf(path)


def test_a_config_json_that_is_no_model_config_is_a_clear_error(tmp_path: Path) -> None:
    from iterserve.config import ConfigError
    from iterserve.executor.weights import load_hf_config

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"config\.json is no model config: .*model_type"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json is no model config"):
        load_hf_config(tmp_path)


def test_a_context_length_past_the_rotary_tables_asks_for_max_model_len() -> None:
    """A GGUF claiming 2^31 positions converted, then asked for 274 GB of rotary tables
    (measured): refused with the flag that serves it."""
    from types import SimpleNamespace

    from iterserve.config import ConfigError
    from iterserve.executor.weights import MAX_POSITIONS, resolve_max_model_len

    huge = SimpleNamespace(max_position_embeddings=2**31)
    with pytest.raises(ConfigError, match=r"2,147,483,648 .* pass --max-model-len"):
        resolve_max_model_len(EngineConfig(), huge)
    assert resolve_max_model_len(EngineConfig.from_kwargs(max_model_len=4096), huge) == 4096
    exact = SimpleNamespace(max_position_embeddings=MAX_POSITIONS)
    assert resolve_max_model_len(EngineConfig(), exact) == MAX_POSITIONS


def test_a_gguf_transformers_cannot_convert_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors whose shapes disagree with the metadata pass the header check and fail inside
    transformers (a reshape, a token id past the vocabulary): one error naming the file,
    nothing cached."""
    monkeypatch.setattr(envs, "ITERSERVE_CACHE_DIR", str(tmp_path / "cache"))  # read at import
    path = _complete_gguf(tmp_path / "model.gguf")

    def fails(gguf: Path, out: Path) -> None:
        (out / "half").write_text("")
        raise ValueError("cannot reshape array of size 110592 into shape (9,10,2,576)\nmore")

    monkeypatch.setattr(loader, "_write_hf_dir", fails)
    with pytest.raises(ModelNotFoundError, match=r"model\.gguf cannot be converted: ValueError"):
        loader.convert_gguf(path)
    assert [p.suffix for p in loader.cache_root().iterdir()] == [".lock"]


def test_a_directory_without_a_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    from iterserve.config import ConfigError
    from iterserve.executor.weights import load_tokenizer

    with pytest.raises(ConfigError, match="no tokenizer transformers can load"):
        load_tokenizer(tmp_path)
