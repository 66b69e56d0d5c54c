"""A uvicorn server that drains on its first exit signal, for the replica and the router.

Kubernetes sends SIGTERM on a rolling update and keeps routing to the pod for a moment (the
endpoint's removal takes time to reach every proxy). So the first SIGTERM (or Ctrl-C) does
not close the listener: the subclass starts draining (``/ready`` turns 503), the server keeps
answering and exits once nothing is active or the grace period is over. After the grace
period the subclass may end what still runs (:meth:`DrainingServer.abort_active`), which gets
:data:`ABORT_WAIT_S` to send its last bytes. A second signal exits at once: what still runs is
aborted first (an error event or a 503 rather than a stream cut mid-way), and uvicorn's
graceful timeout bounds what does not end.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

logger = logging.getLogger("iterserve")

# After the grace period, aborted requests get this long to send their last bytes.
ABORT_WAIT_S = 5.0


class DrainingServer(uvicorn.Server):
    """See the module docstring; subclasses say what draining, active and aborting mean."""

    def __init__(self, config: uvicorn.Config, grace_period_s: float) -> None:
        super().__init__(config)
        self.grace_period_s = grace_period_s
        self.drain_deadline: float | None = None
        self.aborted = False
        self.exit_now = False  # a second signal came during the drain

    def begin_drain(self) -> bool:
        """Start draining; False when there is nothing to drain (the server exits now)."""
        raise NotImplementedError

    def num_active(self) -> int:
        """Requests still being answered."""
        raise NotImplementedError

    def abort_active(self) -> int:
        """End what still runs after the grace period; how many (default: nothing, uvicorn's
        own graceful timeout cuts them)."""
        return 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_deadline is not None or not self.begin_drain():
            self.should_exit = True  # second signal, or nothing started yet: exit now
            self.exit_now = self.drain_deadline is not None
            if sig == signal.SIGINT and self.drain_deadline is not None:
                self.force_exit = True
            return
        self.drain_deadline = time.monotonic() + self.grace_period_s
        logger.info(
            "signal %s: draining %d active requests (grace period %.0f s)",
            signal.Signals(sig).name,
            self.num_active(),
            self.grace_period_s,
        )

    async def on_tick(self, counter: int) -> bool:
        if self.exit_now and not self.aborted:
            # Here, not in the signal handler: aborting touches the event loop's objects.
            logger.warning("second signal: aborted %d requests", self.abort_active())
            self.aborted = True
        if self.drain_deadline is not None and not self.should_exit:
            now = time.monotonic()
            if self.num_active() == 0:
                logger.info("drained; shutting down")
                self.should_exit = True
            elif not self.aborted and now > self.drain_deadline:
                # End what still runs with an error event / 503 rather than cutting streams.
                logger.warning("grace period over: aborted %d requests", self.abort_active())
                self.aborted = True
            elif self.aborted and now > self.drain_deadline + ABORT_WAIT_S:
                logger.warning("%d requests still open; shutting down", self.num_active())
                self.should_exit = True
        return await super().on_tick(counter)
