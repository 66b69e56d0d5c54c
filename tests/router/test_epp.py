"""The endpoint picker's ext_proc protocol over a real gRPC channel, in front of a pool whose
replicas' reports the test writes (no replicas, no Envoy: tests/router/test_gateway.py runs
the real Envoy): what it answers in each phase, the destination header and metadata, the
subset hint, refusals (401, 403, 413, 429, 503), the credentials it puts on the request, and
the pick's in-flight accounting."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from credential_data import KEYS, TOKEN
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from iterserve.router.config import RouterConfig
from iterserve.router.decide import Decider
from iterserve.router.epp import EndpointPicker
from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import ReplicaPool
from iterserve.router.scoring import LoadReport, Picker

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}).encode()


def _picker(*urls: str, **settings: Any) -> EndpointPicker:
    """A picker over ``urls``, all ready and idle (fresh reports), least_kv without affinity."""
    pool = ReplicaPool()
    pool.set_urls(list(urls))
    for b in pool.backends.values():
        b.state.ready = True
        _report(pool, b.url, kv=0.0)
    config = RouterConfig(backend=urls, **settings)
    picker = Picker("least_kv", prefix_affinity=False, seed=0)
    return EndpointPicker(Decider(pool, picker, config, RouterMetrics()))


def _report(pool: ReplicaPool, url: str, kv: float, waiting: int = 0) -> None:
    pool.backends[url].state.report = LoadReport(kv, waiting, 0, 100, time.monotonic())


def _headers(method: str = "POST", eos: bool = False, **extra: str) -> pb.ProcessingRequest:
    pairs = {":method": method, ":path": "/v1/completions", **extra}
    headers = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=headers), end_of_stream=eos
        )
    )
    return message


def _body(body: bytes = BODY) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


def _with_subset(message: pb.ProcessingRequest, endpoints: list[str]) -> pb.ProcessingRequest:
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": endpoints})
    message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


Exchange = Callable[[list[pb.ProcessingRequest]], Awaitable[list[pb.ProcessingResponse]]]


def _run(picker: EndpointPicker, body: Callable[[Exchange], Awaitable[None]]) -> None:
    """``body(exchange)`` with the picker serving on a free port; ``exchange(messages)``
    sends them on one stream (closed after the answers) and returns the answers."""

    async def run() -> None:
        async with (
            picker.serving("127.0.0.1", 0) as port,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            stub = pb_grpc.ExternalProcessorStub(channel)
            await body(lambda messages: _exchange(stub, messages))

    asyncio.run(run())


async def _exchange(stub: Any, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """One stream: each message sent after the answer to the one before (as Envoy does),
    until an immediate response; then the stream closed."""
    queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        while (m := await queue.get()) is not None:
            yield m

    call = stub.Process(requests())
    answers = []
    for m in messages:
        await queue.put(m)
        answer = await call.read()
        while answer.HasField("override_message_timeout"):  # held: the answer follows
            answer = await call.read()
        answers.append(answer)
        if answer.HasField("immediate_response"):
            break
    await queue.put(None)
    while await call.read() != grpc.aio.EOF:
        pass
    return answers


def _set(response: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in response.header_mutation.set_headers}


def _destination(answer: pb.ProcessingResponse) -> tuple[str, str]:
    """(the header, the envoy.lb metadata) of a pick."""
    header = _set(answer.request_body.response)["x-gateway-destination-endpoint"]
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    return header, metadata.fields["x-gateway-destination-endpoint"].string_value


def _immediate(answer: pb.ProcessingResponse) -> tuple[int, dict[str, Any], dict[str, str]]:
    i = answer.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in i.headers.set_headers}
    return i.status.code, json.loads(i.body), headers


def test_a_request_goes_to_the_least_loaded_replica_with_the_others_as_fallbacks() -> None:
    picker = _picker(A, B, C, destination_endpoints=3)
    pool = picker.decider.pool
    _report(pool, A, kv=0.5)
    _report(pool, B, kv=0.1)
    _report(pool, C, kv=0.3)

    async def body(exchange: Exchange) -> None:
        headers_answer, pick = await exchange([_headers(), _body()])
        assert headers_answer.HasField("request_headers")  # continue: the body comes next
        assert not headers_answer.request_headers.response.header_mutation.set_headers
        assert _destination(pick) == ("10.0.0.2:8000,10.0.0.3:8000,10.0.0.1:8000",) * 2
        assert pick.request_body.response.clear_route_cache
        # One attempt on the pick from the answer until the stream closes.
        await _until(lambda: pool.backends[B].in_flight == 0)
        assert picker.metrics.picks.labels(policy="least_kv", reason="least_kv")._value.get() == 1

    _run(picker, body)


def test_the_pick_counts_in_flight_until_the_stream_ends() -> None:
    picker = _picker(A)
    pool = picker.decider.pool

    async def body(exchange: Exchange) -> None:
        async def open_stream() -> None:
            await exchange([_headers(), _body()])

        # While a stream is open, its pick is in flight; the exchange closes it at the end.
        task = asyncio.create_task(open_stream())
        await _until(lambda: pool.backends[A].in_flight == 1 or task.done())
        await task
        await _until(lambda: pool.backends[A].in_flight == 0 and not picker.streams)

    _run(picker, body)


def test_a_request_without_a_body_is_decided_at_its_headers() -> None:
    picker = _picker(A)

    async def body(exchange: Exchange) -> None:
        (answer,) = await exchange([_headers("GET", eos=True, **{":path": "/v1/models"})])
        header = _set(answer.request_headers.response)["x-gateway-destination-endpoint"]
        assert header == "10.0.0.1:8000"

    _run(picker, body)


def test_the_subset_hint_limits_the_candidates() -> None:
    picker = _picker(A, B, C, destination_endpoints=3, hold_timeout_s=0)
    _report(picker.decider.pool, C, kv=0.9)  # the busiest, and the only one allowed

    async def body(exchange: Exchange) -> None:
        _, pick = await exchange([_with_subset(_headers(), ["10.0.0.3:8000"]), _body()])
        assert _destination(pick)[0] == "10.0.0.3:8000"
        # A bare address allows every port of it.
        _, pick = await exchange([_with_subset(_headers(), ["10.0.0.1", "10.0.0.3:8000"]), _body()])
        assert _destination(pick)[0] == "10.0.0.1:8000,10.0.0.3:8000"
        # None of the hinted endpoints is ready: 503 at once (no hold configured).
        _, refused = await exchange([_with_subset(_headers(), ["10.9.9.9:1"]), _body()])
        status, error, headers = _immediate(refused)
        assert status == 503 and headers["retry-after"] == "1"
        assert error["error"]["type"] == "service_unavailable_error"

    _run(picker, body)


def test_sheddable_requests_get_429_when_every_candidate_is_saturated() -> None:
    picker = _picker(A, B)
    pool = picker.decider.pool
    _report(pool, A, kv=0.95)  # KV cache over --shed-kv-usage
    _report(pool, B, kv=0.1, waiting=5)  # a queue of --shed-queue-depth
    best_effort = json.dumps({"prompt": "x", "priority": "best-effort"}).encode()
    standard = json.dumps({"prompt": "x", "priority": "standard"}).encode()

    async def body(exchange: Exchange) -> None:
        _, refused = await exchange([_headers(), _body(best_effort)])
        status, error, headers = _immediate(refused)
        assert (status, error["error"]["code"], headers["retry-after"]) == (429, "shed", "1")
        _, pick = await exchange([_headers(), _body(standard)])  # not sheddable: picked
        assert _destination(pick)[0] in ("10.0.0.1:8000", "10.0.0.2:8000")
        _report(pool, B, kv=0.1, waiting=4)  # one replica below both thresholds: not shed
        _, pick = await exchange([_headers(), _body(best_effort)])
        assert pick.HasField("request_body")  # placed by the score, as any other request
        assert picker.metrics.requests.labels(replica="none", code="429")._value.get() == 1

    _run(picker, body)


def test_keys_tenants_and_the_replicas_token(tmp_path: Path) -> None:
    keys, token = tmp_path / "keys.yaml", tmp_path / "token"
    keys.write_text(KEYS)
    token.write_text(TOKEN)
    picker = _picker(A, api_keys_file=str(keys), router_token_file=str(token))
    acme = {"authorization": "Bearer sk-acme-0001", "x-tenant-id": "mallory"}

    async def body(exchange: Exchange) -> None:
        _, pick = await exchange([_headers(**acme), _body()])
        mutation = pick.request_body.response.header_mutation
        set_headers = _set(pick.request_body.response)
        assert set_headers["authorization"] == f"Bearer {TOKEN}"  # the client's key replaced
        assert set_headers["x-tenant-id"] == "acme"  # the key's tenant, not the client's
        assert json.loads(set_headers["x-iterserve-tiers"]) == ["best-effort", "standard"]
        assert json.loads(set_headers["x-iterserve-default-tier"]) == "standard"
        assert all(
            h.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
            for h in mutation.set_headers
        )
        premium = json.dumps({"prompt": "x", "priority": "premium"}).encode()
        _, forbidden = await exchange([_headers(**acme), _body(premium)])
        assert _immediate(forbidden)[0] == 403

    async def first_refused(exchange: Exchange) -> None:
        (refused,) = await exchange([_headers(), _body()])  # at its headers: no body read
        assert _immediate(refused)[0] == 401
        await body(exchange)

    _run(picker, first_refused)


def test_a_body_over_the_limit_is_413_and_a_streamed_body_is_refused() -> None:
    picker = _picker(A, max_request_body_bytes=64)

    async def body(exchange: Exchange) -> None:
        _, refused = await exchange([_headers(), _body(b"x" * 65)])
        assert _immediate(refused)[0] == 413
        partial = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{", end_of_stream=False))
        _, refused = await exchange([_headers(), partial])
        status, error, _ = _immediate(refused)
        assert status == 500 and "BUFFERED" in error["error"]["message"]

    _run(picker, body)


def test_the_served_endpoint_is_counted() -> None:
    picker = _picker(A, B, destination_endpoints=2)
    _report(picker.decider.pool, B, kv=0.5)  # A is the pick, B the fallback
    served = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                    base_pb2.HeaderValue(
                        key="x-gateway-destination-endpoint-served", raw_value=b"10.0.0.2:8000"
                    ),
                ]
            )
        )
    )

    async def body(exchange: Exchange) -> None:
        _, pick, answer = await exchange([_headers(), _body(), served])
        assert _destination(pick)[0] == "10.0.0.1:8000,10.0.0.2:8000"
        assert answer.HasField("response_headers")
        m = picker.metrics
        assert m.served.labels(replica="10.0.0.2:8000", picked="false")._value.get() == 1
        assert m.requests.labels(replica="10.0.0.2:8000", code="200")._value.get() == 1

    _run(picker, body)


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_after_the_drain_new_requests_get_503() -> None:
    picker = _picker(A)

    async def body(exchange: Exchange) -> None:
        assert picker.abort_active() == 0  # the drain is over: nothing was open
        (refused,) = await exchange([_headers(), _body()])
        status, error, headers = _immediate(refused)
        assert (status, headers["retry-after"]) == (503, "1")
        assert "shutting down" in error["error"]["message"]

    _run(picker, body)
