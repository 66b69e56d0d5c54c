"""Child processes that die with the process that started them.

Every process of a local cluster is started with ``PR_SET_PDEATHSIG`` (SIGKILL when the
thread that started it ends: the process dying, even by SIGKILL, ends every thread) in a
session of its own, so a crashed test
run leaves no etcd, API server or pod behind; a clean stop sends SIGTERM to the whole
process group first and SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Process:
    """One started command, its output appended to ``log``. Start it from a thread that
    lives as long as it should (the main thread, the pod runner's watch and probe threads):
    the parent-death signal follows the starting thread."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        """None while it runs."""
        return self.popen.poll()

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM to its process group, SIGKILL after ``grace_s``; its exit code."""
        return stop_all([self], grace_s)[0]

    def tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""


def stop_all(processes: Sequence[Process], grace_s: float = 10.0) -> list[int]:
    """SIGTERM to every process group at once, SIGKILL to those still running after
    ``grace_s``; their exit codes. Children left in a group (a server's engine process)
    are killed too."""
    for p in processes:
        if p.popen.poll() is None:
            p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in processes:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.signal_group(signal.SIGKILL)
            p.popen.wait()
        p.signal_group(signal.SIGKILL)
    return [int(p.popen.returncode) for p in processes]
