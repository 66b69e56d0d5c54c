"""SSE responses whose client must keep reading: a request whose client stopped reading past a
timeout is aborted and its KV blocks freed (docs/server.md, "Requests").

A stream's chunks wait in two places once its client reads slower than the engine writes: the
socket (the kernel's buffers, then uvicorn's transport up to its 64 KiB high-water mark, where
uvicorn's ``send`` starts to wait for the client) and, while ``send`` waits, the generation
run's queue of engine deltas. The engine never waits on either (each request's deltas reach
its run on their own task). Neither may grow without bound, and a client that has stopped
reading must not hold a sequence's seat and KV blocks until ``max_tokens``. So a stream is
dropped (its engine requests aborted: their blocks are free at the next iteration boundary)
when one ``send`` has waited ``stream_stall_timeout_s`` for the client, or when more than
``max_stream_buffer_chunks`` deltas wait unsent, whichever comes first.

ASGI cannot close a connection mid-response: the response returns unfinished, and uvicorn
closes the connection (its log says "ASGI callable returned without completing response"),
after the bytes already in the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

logger = logging.getLogger("iterserve.server")


class _Dropped(Exception):
    pass


class WatchedStreamingResponse(StreamingResponse):
    """A :class:`StreamingResponse` that gives up on a client who stopped reading.

    Args:
        content: the SSE body (an async generator: it is closed when the client is dropped,
            which aborts its engine requests).
        request_id: for the log line.
        stall_timeout_s: seconds one chunk may wait for the client to take the previous ones
            (None: forever).
        kwargs: those of :class:`StreamingResponse`.
    """

    def __init__(
        self, content: Any, request_id: str, stall_timeout_s: float | None, **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self.request_id = request_id
        self.stall_timeout_s = stall_timeout_s
        self.drop_reason: str | None = None
        self._send_timeout: asyncio.Timeout | None = None

    def drop(self, reason: str) -> None:
        """Give up on the client now (the waiting ``send`` ends at once), saying why."""
        if self.drop_reason is None:
            self.drop_reason = reason
        if self._send_timeout is not None:
            with contextlib.suppress(RuntimeError):  # it is expiring already
                self._send_timeout.reschedule(asyncio.get_running_loop().time())

    async def stream_response(self, send: Send) -> None:
        async def watched(message: Message) -> None:
            if self.drop_reason is not None:
                raise _Dropped
            try:
                async with asyncio.timeout(self.stall_timeout_s) as self._send_timeout:
                    await send(message)
            except TimeoutError:
                if self.drop_reason is None:
                    self.drop_reason = f"took no bytes for {self.stall_timeout_s:g} s"
                raise _Dropped from None
            finally:
                self._send_timeout = None

        try:
            await super().stream_response(watched)
        except _Dropped:
            logger.warning(
                "request %s: the client %s; dropped it and aborted the request",
                self.request_id,
                self.drop_reason,
            )
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
