"""Builds the C kernels in ``kernels/csrc`` for this CPU at first use and loads them.

The shared library is compiled with the system C compiler (``$CC`` or ``cc``; ``-O3
-march=native -fopenmp``, plus ``ITERSERVE_KERNEL_CFLAGS``) into the iterserve cache
directory, keyed by the sources, the flags and this CPU's feature flags, so a cache carried
to another CPU is rebuilt rather than run with instructions that CPU lacks. Compiling takes
about a second; nothing is compiled or probed at import. Without a compiler the kernels are
unavailable and ``auto`` falls back to plain torch (:func:`load_cpu_kernels` returns ``None``;
see :func:`~iterserve.kernels.platform.select_platform`).

The library links ``libgomp.so.1`` by soname. torch (imported first, as this module does)
already loaded its own copy under that soname, so the kernels run on torch's OpenMP thread
pool: two runtimes on two cores would spin against each other.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before the kernels' library)

from iterserve import envs

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("paged_decode_attention.c", "layer_ops.c", "quant_ops.c")
HEADERS = ("common.h",)
# No floating-point contraction: the layer ops round like their torch references (layer_ops.c).
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


def _cpu_id() -> str:
    """This CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _cache_dir() -> Path:
    """Beside the converted models (``ITERSERVE_CACHE_DIR`` or the user cache dir)."""
    return envs.cache_dir() / "kernels"


def _cflags() -> tuple[str, ...]:
    return CFLAGS + tuple(envs.ITERSERVE_KERNEL_CFLAGS.split())


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _compile(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile next to the target and rename: concurrent builders never see half a library.
    # The sha256 sidecar goes in first, so a library is only ever trusted with its checksum.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    tmp_sum = tmp + ".sha256"
    try:
        cmd = [compiler, *_cflags(), *(str(CSRC / s) for s in SOURCES), "-o", tmp, "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        Path(tmp_sum).write_text(hashlib.sha256(Path(tmp).read_bytes()).hexdigest())
        os.replace(tmp_sum, _sidecar(out))
        os.replace(tmp, out)
    finally:
        for leftover in (tmp, tmp_sum):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _intact(path: Path) -> bool:
    """Whether the cached library is whole: its sha256 matches the one written when it was
    built. A truncated library can keep a valid ELF header, pass ``dlopen`` and then kill the
    process with SIGBUS when a missing page is touched, so ``OSError`` is not enough."""
    try:
        expected = _sidecar(path).read_text().strip()
        return hashlib.sha256(path.read_bytes()).hexdigest() == expected
    except OSError:
        return False


@functools.cache
def load_cpu_kernels() -> ctypes.CDLL | None:
    """The compiled kernels, built on first call; ``None`` where they cannot be built.

    Not thread-safe on first call within one process (the engine calls it when it builds
    the model runner); concurrent processes are safe.
    """
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU attention kernels disabled, using plain torch")
        return None
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join((compiler, *_cflags(), _cpu_id())).encode())
    path = _cache_dir() / f"iterserve_cpu_kernels-{digest.hexdigest()[:16]}.so"
    for attempt in range(2):
        if path.exists() and not _intact(path):
            logger.warning("%s is damaged or incomplete; rebuilding", path)
            path.unlink(missing_ok=True)
        if not path.exists():
            logger.info("building the CPU kernels (once per CPU and version) into %s", path)
            try:
                _compile(compiler, path)
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                logger.warning("building the CPU kernels failed, using plain torch: %s", detail)
                return None
        try:
            return ctypes.CDLL(str(path))
        except OSError as e:
            logger.warning("cannot load %s (%s)%s", path, e, "; rebuilding" if not attempt else "")
            path.unlink(missing_ok=True)
    logger.warning("the CPU kernels cannot be loaded, using plain torch")
    return None
