"""A streaming client that stops reading (docs/reliability.md, "Slow clients"): the other
streams keep their pace, and the stalled one is dropped and its request aborted, after
``stream_stall_timeout_s`` or once ``max_stream_buffer_chunks`` wait unsent. Over the fake
engine, stepping every few milliseconds; the stalled client is a raw socket with a tiny
receive buffer, and the server's kernel send buffer is fixed at 4 KiB (Linux would grow it to
4 MiB, which takes a stalled stream minutes of tokens to fill: the same state, reached later)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fake_engine import FakeEngineClient, serve_in_process, until

from iterserve.config import ServerConfig

STEP_INTERVAL_S = 0.005


class StalledClient:
    """A raw HTTP/1.1 client that reads the response head and then stops reading."""

    def __init__(self, url: str) -> None:
        self.host, self.port = urlsplit(url).hostname, urlsplit(url).port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect
        self.sock.setblocking(False)
        self.received = b""

    async def start(self, body: dict[str, Any]) -> str:
        """Send the request, read up to the first chunk; the response's request id."""
        loop = asyncio.get_running_loop()
        await loop.sock_connect(self.sock, (self.host, self.port))
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        await loop.sock_sendall(self.sock, head.encode() + payload)
        while b"data: " not in self.received:
            self.received += await loop.sock_recv(self.sock, 1024)
        headers = self.received.split(b"\r\n\r\n")[0].decode().lower().splitlines()
        assert headers[0].startswith("http/1.1 200")
        return next(h.split(": ")[1] for h in headers if h.startswith("x-request-id"))

    async def read_to_end(self, timeout_s: float) -> bytes:
        """Resume reading until the server closes the connection."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s):
            while data := await loop.sock_recv(self.sock, 65536):
                self.received += data
        return self.received


async def paced_stream(http: httpx.AsyncClient, max_tokens: int) -> tuple[int, float, bool]:
    """A client that reads: its tokens, the longest gap between two chunks (s), [DONE]."""
    body = {"prompt": "A reader", "max_tokens": max_tokens, "stream": True}
    num_tokens, longest, done, last = 0, 0.0, False, time.monotonic()
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            longest, last = max(longest, now - last), now
            if line == "data: [DONE]":
                done = True
            else:
                num_tokens += len(json.loads(line[6:])["choices"])
    return num_tokens, longest, done


def run_stalled_stream(
    tokenizer: Any, caplog: pytest.LogCaptureFixture, server_config: ServerConfig
) -> tuple[float, bytes, tuple[int, float, bool], FakeEngineClient]:
    """A stalled stream (n=4, 1,000 tokens each) beside a reading one (300 tokens): seconds
    until the stalled one was aborted, what it received, the reader's result, the fake."""
    fake = FakeEngineClient(tokenizer, time.monotonic, step_interval_s=STEP_INTERVAL_S)
    caplog.set_level(logging.WARNING, logger="iterserve.server")

    async def main() -> tuple[float, bytes, tuple[int, float, bool]]:
        async with (
            serve_in_process(fake, server_config, send_buffer_bytes=4096) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            stalled = StalledClient(url)
            try:
                started = time.monotonic()
                body = {"prompt": "A stalled reader", "max_tokens": 1000, "n": 4, "stream": True}
                request_id = await stalled.start(body)
                reader = asyncio.create_task(paced_stream(http, 300))
                await until(lambda: request_id in fake.aborted, "the stalled stream was dropped")
                dropped_after = time.monotonic() - started
                received = await stalled.read_to_end(10)
                result = await reader
                print(f"dropped after {dropped_after:.2f} s; reader {result}; ", end="")
            finally:  # else the server's shutdown waits for it
                stalled.sock.close()
            load = (await http.get("/load")).json()
            assert load["num_running"] == load["num_waiting"] == 0
            assert load["num_free_blocks"] == load["num_total_blocks"]
            return dropped_after, received, result

    return (*asyncio.run(main()), fake)


def test_a_stalled_stream_is_dropped_after_the_timeout(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig(stream_stall_timeout_s=1.0)
    dropped_after, received, reader, fake = run_stalled_stream(tokenizer, caplog, config)
    # Filling the socket's buffers takes well under a second, the 1,000 tokens 5 s or more.
    assert 1.0 < dropped_after < 4.0
    assert b"data: [DONE]" not in received  # cut, not finished
    assert reader == (300, pytest.approx(0, abs=0.5), True)  # never held up
    assert len(fake.aborted) == 1
    assert "took no bytes for 1 s; dropped it and aborted the request" in caplog.text


def test_a_stream_with_too_many_unsent_chunks_is_dropped_before_the_timeout(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig(stream_stall_timeout_s=60.0, max_stream_buffer_chunks=20)
    dropped_after, received, reader, fake = run_stalled_stream(tokenizer, caplog, config)
    assert dropped_after < 4.0
    assert b"data: [DONE]" not in received
    assert reader == (300, pytest.approx(0, abs=0.5), True)
    assert len(fake.aborted) == 1
    assert "left more than 20 chunks unread; dropped it" in caplog.text
