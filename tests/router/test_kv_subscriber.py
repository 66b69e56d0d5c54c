"""The router's subscriptions to its replicas' KV events over real ZMQ sockets: events reach the
index, a replica leaving the set is dropped, a publisher that goes away and comes back (a
restarted replica) clears what the index knew, and everything closes on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import pytest
import zmq
from router_utils import until

from iterserve.kv_events import AllBlocksCleared, BlockStored, EventBatch, encode_message
from iterserve.router.kv_index import KvIndex
from iterserve.router.kv_subscriber import KvEventsSubscriber, events_endpoint
from iterserve.router.pool import ReplicaPool

BLOCK = (1, 2, 3, 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def publisher(port: int) -> Iterator[zmq.Socket[bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    try:
        yield sock
    finally:
        sock.close(linger=0)
        ctx.term()


def test_events_endpoint() -> None:
    assert events_endpoint("http://10.1.2.3:8000", 5557) == "tcp://10.1.2.3:5557"
    assert events_endpoint("http://[fd00::1]:8000/", 5557) == "tcp://[fd00::1]:5557"


def test_subscriptions_follow_the_pool_and_a_restarted_publisher_clears_its_replica() -> None:
    port = _free_port()
    pool = ReplicaPool()
    pool.set_urls(["http://127.0.0.1:1"])  # the replica's name: 127.0.0.1:1
    name = "127.0.0.1:1"
    index = KvIndex()
    subscriber = KvEventsSubscriber(pool, index, port, reconcile_interval_s=0.02)

    async def publish_until_held(pub: zmq.Socket[bytes], first_seq: int) -> int:
        """Publish numbered batches until the index holds the block (a SUB misses what is
        sent before its subscription reaches the PUB); the next sequence number."""
        seq = first_seq
        stored = BlockStored((seq + 1000,), None, BLOCK, 4)
        while index.num_blocks(name) == 0:
            pub.send_multipart(encode_message("kv@p@m", seq, EventBatch(0.0, (stored,))))
            seq += 1
            await asyncio.sleep(0.02)
            assert seq < first_seq + 500, "no event reached the index"
        return seq

    async def run() -> None:
        task = asyncio.create_task(subscriber.run())
        try:
            with publisher(port) as pub:
                seq = await publish_until_held(pub, 0)
                assert index.matched_blocks(list(BLOCK), [name]) == {name: 1}
                pub.send_multipart(
                    encode_message("kv@p@m", seq, EventBatch(0.0, (AllBlocksCleared(),)))
                )
                await until(lambda: index.num_blocks(name) == 0, "cleared by the event")
            # The publisher went away: the disconnect clears the replica's sequence, so the
            # restarted one's batches from 0 are no gap.
            await until(lambda: index.replicas[name].last_seq is None, "disconnect seen")
            with publisher(port) as pub:
                await publish_until_held(pub, 0)
            assert index.counters.gaps == 0 and subscriber.num_connects >= 2
            pool.set_urls([])  # the replica left the set
            await until(lambda: name not in index.replicas, "dropped from the index")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert not subscriber._tasks

    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_message_over_the_size_limit_is_refused_by_the_transport() -> None:
    """A rogue publisher's huge message is never buffered whole: ZMQ drops the connection
    at ``max_message_bytes`` (the subscription reconnects and goes on)."""
    port = _free_port()
    pool = ReplicaPool()
    pool.set_urls(["http://127.0.0.1:1"])
    name = "127.0.0.1:1"
    index = KvIndex()
    subscriber = KvEventsSubscriber(
        pool, index, port, reconcile_interval_s=0.02, max_message_bytes=1024
    )
    stored = EventBatch(0.0, (BlockStored((7,), None, BLOCK, 4),))

    async def run() -> None:
        task = asyncio.create_task(subscriber.run())
        try:
            with publisher(port) as pub:
                seq = 0
                while index.num_blocks(name) == 0:  # subscribed
                    pub.send_multipart(encode_message("kv@p@m", seq, stored))
                    seq += 1
                    await asyncio.sleep(0.02)
                pub.send_multipart([b"kv@p@m", seq.to_bytes(8, "big"), b"\xc1" * 4096])
                await until(lambda: subscriber.num_connects >= 2, "dropped and reconnected")
                while index.num_blocks(name) == 0:  # events flow again
                    seq += 1
                    pub.send_multipart(encode_message("kv@p@m", seq, stored))
                    await asyncio.sleep(0.02)
            assert index.counters.malformed == 0  # never received, so never decoded
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_failure_inside_a_subscription_is_logged_and_it_subscribes_anew(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug in handling one message (here: the index raising once) ends that subscription
    with its traceback logged, and the next reconcile subscribes again: events flow on."""
    port = _free_port()
    pool = ReplicaPool()
    pool.set_urls(["http://127.0.0.1:1"])
    name = "127.0.0.1:1"
    index = KvIndex()
    apply_frames, calls = index.apply_frames, []

    def failing_once(replica: str, frames: list[bytes]) -> None:
        calls.append(replica)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        apply_frames(replica, frames)

    index.apply_frames = failing_once  # type: ignore[method-assign]
    subscriber = KvEventsSubscriber(pool, index, port, reconcile_interval_s=0.02)

    async def run() -> None:
        task = asyncio.create_task(subscriber.run())
        try:
            with publisher(port) as pub:
                for seq in range(600):
                    stored = BlockStored((seq + 1000,), None, BLOCK, 4)
                    pub.send_multipart(encode_message("kv@p@m", seq, EventBatch(0.0, (stored,))))
                    await asyncio.sleep(0.01)
                    if index.num_blocks(name):
                        break
                assert index.num_blocks(name) == 1, "no event reached the index after the failure"
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(run())
    assert "the subscription failed" in caplog.text and "RuntimeError: a bug" in caplog.text
