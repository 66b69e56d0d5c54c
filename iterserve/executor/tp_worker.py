"""A tensor-parallel worker process (ranks ``1 .. N-1``), started by
:class:`~iterserve.executor.tensor_parallel.Workers` as ``python -m iterserve.executor.tp_worker
--fd FD``: it reads its :class:`~iterserve.executor.tensor_parallel.WorkerSetup` from the
socket ``FD``, builds its shard, then runs every step the driver sends until shutdown or EOF.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import pickle
import sys
from multiprocessing.connection import Connection

import torch.distributed as dist

from iterserve.executor.build import build_shard
from iterserve.executor.tensor_parallel import WorkerSetup, init_group
from iterserve.executor.tp_messages import StepDecoder, StepMessage

logger = logging.getLogger(__name__)


def worker_main(fd: int) -> int:
    """A worker process: read its :class:`WorkerSetup`, build its shard, then run each
    :class:`StepMessage` until shutdown or the socket's EOF; the exit code."""
    from iterserve.engine.process_engine import (
        LOG_FORMAT,
        die_with_parent,
        leave_stop_signals_to_parent,
    )

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    conn = Connection(fd)
    setup: WorkerSetup = pickle.loads(conn.recv_bytes())
    die_with_parent(setup.parent_pid)
    leave_stop_signals_to_parent()  # the driver stops it (a shutdown message, or SIGKILL)
    tp = init_group(setup.rank, setup.size, setup.init_method)
    runner = build_shard(setup.config, setup.model_dir, tp).runner
    decoder = StepDecoder()
    logger.info("tensor-parallel rank %d of %d ready", tp.rank, tp.size)
    while True:
        try:
            msg: StepMessage = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            logger.info("rank %d: the driver closed its socket; stopping", tp.rank)
            return 0
        if msg.shutdown:
            return 0
        runner.execute_model(decoder.decode(msg))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="an iterserve tensor-parallel worker")
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    code = 1
    try:
        code = worker_main(args.fd)
    except Exception:
        logger.exception("tensor-parallel worker failed")
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
