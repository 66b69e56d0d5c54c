"""Tensor parallelism across processes: one replica's model sharded over ``N`` ranks.

The engine process is rank 0, the driver: it runs the scheduler, its own shard, and samples.
Ranks ``1 .. N-1`` are worker processes (:mod:`~iterserve.executor.tp_worker`) that load
their shard, size their KV cache, then run every iteration the driver announces. The driver's
runner is a :class:`TensorParallelRunner`: each iteration it sends one
:class:`~iterserve.executor.tp_messages.StepMessage` to every worker over its socket (pickled
once), then runs its own shard. All ranks run the same forward in lockstep; the collectives
inside it (:mod:`~iterserve.models.parallel`) are the only other traffic.

Failure: the driver watches every worker; a worker that exits (killed, OOM, an exception)
fails the driver at once: in the engine process (``fail_fast``) it exits with code 1, so the
server's streams all end with an error, ``/health`` fails and the server exits non-zero;
elsewhere (``LLM(...)``) the step raises :class:`TensorParallelError`, and so does every
later one. A hung worker is caught by the collective timeout (``ITERSERVE_TP_TIMEOUT_S``,
default 60 s, from the first step on; joining the group and loading the shards have
``ITERSERVE_TP_START_TIMEOUT_S``, default 900 s), and any error in the driver's forward is as
fatal (the ranks are out of step after it). Workers die with the driver
(``PR_SET_PDEATHSIG``) and stop on their socket's EOF: no process outlives the driver.

On a CPU the cores are divided among the ranks (``torch.set_num_threads``) so that ``N``
processes on one machine do not oversubscribe them. Backend: NCCL with one GPU per rank when
CUDA is present, gloo otherwise.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from iterserve.engine.outputs import ModelRunnerOutput, SchedulerOutput
from iterserve.engine.policy import PreemptionCosts
from iterserve.executor.model_runner import TorchModelRunner
from iterserve.executor.tp_messages import StepEncoder, StepMessage
from iterserve.models.parallel import TPGroup

logger = logging.getLogger(__name__)

# The module a worker process runs (``python -m``).
WORKER_MODULE = "iterserve.executor.tp_worker"
DEFAULT_TIMEOUT_S = 60.0
# Joining the group and loading the shards: ranks load at their own pace (a 70B shard from a
# cold disk takes minutes), so start-up has its own, longer bound.
DEFAULT_START_TIMEOUT_S = 900.0


class TensorParallelError(RuntimeError):
    """A rank died, hung past the collective timeout or failed a step: the replica's shards
    are out of step and it cannot run any more iterations."""


def collective_timeout_s() -> float:
    """Seconds a step's collective may wait for the other ranks (``ITERSERVE_TP_TIMEOUT_S``)."""
    return float(os.environ.get("ITERSERVE_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def start_timeout_s() -> float:
    """Seconds joining the group and the start-up collectives (the KV pool agreed after every
    rank has loaded its shard) may wait (``ITERSERVE_TP_START_TIMEOUT_S``)."""
    return float(os.environ.get("ITERSERVE_TP_START_TIMEOUT_S", DEFAULT_START_TIMEOUT_S))


def use_step_timeout() -> None:
    """From now on bound this rank's collectives by :func:`collective_timeout_s` (each rank
    calls it once its shard is built; the group starts with :func:`start_timeout_s`)."""
    # torch's one call for a live group's timeout (gloo and NCCL); private, so checked.
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        logger.warning(
            "this torch cannot change a process group's timeout: steps keep the start-up timeout"
        )
        return
    set_timeout(datetime.timedelta(seconds=collective_timeout_s()))


# ---------------------------------------------------------------- the process group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_group(rank: int, size: int, init_method: str) -> TPGroup:
    """Join the ``size``-rank process group (blocks until every rank has joined, at most the
    start-up timeout, which bounds the collectives until :func:`use_step_timeout`); pins this
    rank's GPU under CUDA, divides the CPU cores otherwise.

    Raises:
        RuntimeError: the other ranks did not join in time.
    """
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        backend = "nccl"
    else:
        backend = "gloo"
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        torch.set_num_threads(max(1, cores // size))
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=start_timeout_s()),
    )
    return TPGroup(rank, size)


# ---------------------------------------------------------------- the driver's side


@dataclass(frozen=True)
class WorkerSetup:
    """The first message a worker reads: everything it needs to build its shard."""

    rank: int
    size: int
    init_method: str
    config: Any  # EngineConfig, max_model_len resolved
    model_dir: str
    parent_pid: int


class Workers:
    """Ranks ``1 .. size-1`` as child processes, started before the driver joins the group.

    Args:
        size: the tensor-parallel degree.
        config: the engine config (its ``max_model_len`` resolved).
        model_dir: the resolved model directory every rank loads its shard from.
        fail_fast: a worker's death ends this process (exit code 1) rather than failing the
            next step (the engine process sets it: the server then exits too).
    """

    def __init__(self, size: int, config: Any, model_dir: str, fail_fast: bool) -> None:
        self.size = size
        self.fail_fast = fail_fast
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.encoder = StepEncoder()
        self.dead: str | None = None
        self._lock = threading.Lock()
        self._closing = False
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        try:
            for rank in range(1, size):
                self._start(rank, config, model_dir)
        except BaseException:
            self.close()
            raise
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(
                target=self._watch,
                args=(rank, proc),
                name=f"iterserve-tp-watch-{rank}",
                daemon=True,
            ).start()

    def _start(self, rank: int, config: Any, model_dir: str) -> None:
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, "--fd", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
            )
        finally:
            theirs.close()
        self.procs.append(proc)
        conn = Connection(ours.detach())
        self.conns.append(conn)
        setup = WorkerSetup(rank, self.size, self.init_method, config, model_dir, os.getpid())
        conn.send_bytes(pickle.dumps(setup))

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._closing:
            return
        from iterserve.engine.process_engine import describe_exit

        self.fail(f"tensor-parallel worker rank {rank} died ({describe_exit(code)})")

    def fail(self, reason: str) -> None:
        """The replica is broken (``reason``): exit this process (``fail_fast``) or kill the
        workers and refuse every later step."""
        with self._lock:
            first, self.dead = self.dead is None, self.dead or reason
        if not first:  # the workers killed below report their deaths too
            if self.fail_fast:
                # Another thread is ending the process: a step thread that went on would fail
                # its requests one by one while /health still answers 200.
                threading.Event().wait()
            return
        logger.error("%s: this replica cannot run", reason)
        self.kill()
        if self.fail_fast:
            logging.shutdown()
            os._exit(1)

    def step_failed(self, error: BaseException) -> TensorParallelError:
        """The driver's forward raised ``error``: fatal for the replica (see :meth:`fail`);
        the error to raise when not ``fail_fast``."""
        # A rank's death usually shows first as a collective's connection error here: name
        # the dead rank when one exits within a second, rather than the socket error.
        deadline = time.monotonic() + 1.0
        while self.dead is None and time.monotonic() < deadline:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None:
                    from iterserve.engine.process_engine import describe_exit

                    self.fail(f"tensor-parallel worker rank {rank} died ({describe_exit(code)})")
                    break
            else:
                time.sleep(0.05)
        self.fail(self.dead or f"a tensor-parallel step failed ({type(error).__name__}: {error})")
        return TensorParallelError(self.dead)

    def broadcast(self, out: SchedulerOutput) -> None:
        """Send ``out`` to every worker (before the driver's own forward).

        Raises:
            TensorParallelError: a worker is gone.
        """
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        data = pickle.dumps(self.encoder.encode(out), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            raise TensorParallelError(self.dead or f"a tensor-parallel worker is gone ({e})") from e

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.kill()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every worker (a shutdown message, then SIGKILL after ``timeout_s``) and leave
        the process group; idempotent."""
        if self._closing:
            return
        self._closing = True
        data = pickle.dumps(StepMessage(shutdown=True))
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(data)
                conn.close()
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------- the driver's runner


class TensorParallelRunner:
    """The driver's model runner of a tensor-parallel replica (the engine's ``ModelRunner``):
    each step goes to every worker first, then runs on the driver's own shard, which samples.
    Any failure of a step is the replica's failure (:meth:`Workers.fail`).

    Args:
        driver: rank 0's runner (its shard, KV cache and sampler).
        workers: ranks ``1 .. N-1``, in the process group with the driver.
    """

    def __init__(self, driver: TorchModelRunner, workers: Workers) -> None:
        self.driver = driver
        self.workers = workers
        self.device = driver.device
        self.states = driver.states

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast ``scheduler_output`` to the workers, then run it on the driver.

        Raises:
            TensorParallelError: a rank died, timed out or failed the step: the replica
                cannot continue.
        """
        try:
            self.workers.broadcast(scheduler_output)
            return self.driver.execute_model(scheduler_output)
        except Exception as e:
            raise self.workers.step_failed(e) from e

    def measure_preemption_costs(self) -> PreemptionCosts:
        """The driver's timing of a prefill and a swap, every rank running the prefill."""
        return self.driver.measure_preemption_costs(execute=self.execute_model)

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        self.workers.close()
