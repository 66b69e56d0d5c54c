"""The router as a gateway's endpoint picker: an Envoy ``ext_proc`` gRPC server speaking the
Gateway API Inference Extension's endpoint-picker protocol (GAIE proposal 004), over the same
pool, scoring and decisions as the proxy (:mod:`iterserve.router.decide`). docs/gateway.md.

One gRPC stream per HTTP request, the gateway asking and the picker answering::

    gateway (Envoy)                          picker
    request_headers  ---------------------->  read key (401), method, path, subset hint
                     <----------------------  continue (the body is buffered: BUFFERED)
    request_body (whole, end_of_stream) --->  decide (403), hold (503), rank, shed (429)
                     <----------------------  header mutations + envoy.lb metadata:
                                              x-gateway-destination-endpoint: ip:port[,ip:port]
                                              (or an ImmediateResponse: 401/403/413/429/503)
    (Envoy sends the request to that endpoint)
    response_headers ---------------------->  x-gateway-destination-endpoint-served, :status
                     <----------------------  continue
    (stream closes when the HTTP stream ends)  the pick's in-flight attempt ends

A request without a body (``GET /v1/models``) is decided at its headers. The pick counts in
its replica's in-flight numbers (:meth:`~iterserve.router.pool.ReplicaPool.begin_attempt`)
from the answer until the stream closes (Envoy closes it when the HTTP stream is over, the
answer streamed to its end). The mutations do to the request what the proxy does: the
client's ``Authorization`` replaced by the replicas' key (or removed), the trusted tenant and
tier headers set from the client's key (``--api-keys-file``), a client's own destination
header overwritten.

Generated code: ``xds-protos`` (Envoy's protos as published), never hand-written messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from iterserve.credentials import TRUSTED_HEADERS, Grant
from iterserve.openai_http import APIError
from iterserve.router.asgi import shutting_down
from iterserve.router.decide import Decider, Decision, Ranking, endpoint_of, no_ready_replica
from iterserve.router.envoy_bootstrap import PICKER_DETAILS_PREFIX
from iterserve.router.pool import Backend, OpenAttempt

logger = logging.getLogger("iterserve.router")

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# How much longer than the hold the gateway is asked to wait for the answer
# (``override_message_timeout``; the bootstrap's ``max_message_timeout`` must allow it).
HOLD_MARGIN_S = 5


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc service (see the module docstring). ``streams`` are the open ones (the
    drain waits for none); :meth:`abort_active` refuses new ones."""

    def __init__(self, decider: Decider) -> None:
        self.decider = decider
        self.config = decider.config
        self.metrics = decider.metrics
        self.streams: set[PickerStream] = set()
        self.aborting = False
        self.port: int | None = None  # bound, once serving

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = PickerStream(self)
        self.streams.add(stream)
        try:
            async for message in request_iterator:
                async for response in stream.answer(message):
                    yield response
        finally:
            stream.close()
            self.streams.discard(stream)

    def abort_active(self) -> int:
        """Refuse new requests (503) from now on (the drain is over); how many streams were
        open (they end when the gRPC server stops)."""
        self.aborting = True
        return len(self.streams)

    @contextlib.asynccontextmanager
    async def serving(self, host: str, port: int) -> AsyncIterator[int]:
        """The gRPC server on ``host:port`` (0: a free port) for the block; yields the port.

        Raises:
            RuntimeError: the port cannot be bound.
        """
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(self, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError as e:
            raise RuntimeError(f"--grpc-port: cannot listen on {address} ({e})") from e
        await server.start()
        logger.info("endpoint picker (ext_proc) listening on %s:%d", host, self.port)
        try:
            yield self.port
        finally:
            await server.stop(grace=1.0)


class PickerStream:
    """One request's ext_proc stream: what the picker read of it, and its pick."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.decider = picker.decider
        self.headers: dict[str, str] = {}
        self.grant: Grant | None = None
        self.subset: list[str] | None = None
        self.attempt: OpenAttempt | None = None
        self.picked: Backend | None = None

    async def answer(self, message: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        """The responses to one message of the gateway (module docstring)."""
        phase = message.WhichOneof("request")
        if phase == "request_headers":
            self._read_headers(message)
            try:
                self._admit()
            except APIError as refusal:
                yield _immediate(refusal)
                return
            if message.request_headers.end_of_stream:  # no body: decide now
                async for response in self._decide(b"", "request_headers"):
                    yield response
            else:
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        elif phase == "request_body":
            if not message.request_body.end_of_stream:
                why = "the picker needs the whole body: set request_body_mode BUFFERED"
                yield _immediate(APIError(500, why, "internal_server_error"))
                return
            async for response in self._decide(message.request_body.body, "request_body"):
                yield response
        elif phase == "response_headers":
            self._served(message.response_headers)
            yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        elif phase == "response_body":
            yield pb.ProcessingResponse(response_body=pb.BodyResponse())
        elif phase == "request_trailers":
            yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        elif phase == "response_trailers":
            yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    def _read_headers(self, message: pb.ProcessingRequest) -> None:
        for h in message.request_headers.headers.headers:
            value = h.raw_value.decode("latin-1") if h.raw_value else h.value
            self.headers[h.key.lower()] = value
        self.subset = _subset_hint(message)

    async def _decide(self, body: bytes, phase: str) -> AsyncIterator[pb.ProcessingResponse]:
        """The pick for the request read so far (its whole ``body``), answered in ``phase``'s
        response; or an ImmediateResponse with the refusal."""
        decider = self.decider
        try:
            decision = self._read(body)
            if not decider.candidates(subset=self.subset) and decider.config.hold_timeout_s:
                # Held: the gateway must wait longer than its per-message timeout.
                wait = duration_pb2.Duration(seconds=int(decider.config.hold_timeout_s))
                wait.seconds += HOLD_MARGIN_S
                yield pb.ProcessingResponse(override_message_timeout=wait)
            try:
                await decider.hold(self.subset)
            except asyncio.CancelledError:
                # The gateway closed the stream (its client left, or its message timeout,
                # below the hold, ran out: a 504 there that the picker would not see else).
                logger.info("a held request's stream closed by the gateway before a replica")
                raise
            decision = await decider.with_prompt_tokens(decision)
            ranking = decider.rank(decision, subset=self.subset)
            if ranking is None:  # turned unready meanwhile, or no such endpoint in the subset
                raise no_ready_replica()
            if (refusal := decider.shed(decision, ranking)) is not None:
                raise refusal
        except APIError as refusal:
            if refusal.status in (429, 503):
                self.picker.metrics.requests.labels(replica="none", code=str(refusal.status)).inc()
            yield _immediate(refusal)
            return
        yield self._pick(ranking, phase)

    def _admit(self) -> None:
        """Whether the request is taken at all, from its headers (its grant).

        Raises:
            APIError: 503 the router is shutting down, 401 no key or a wrong one.
        """
        if self.picker.aborting:
            raise shutting_down()
        authorization = self.headers.get("authorization", "").encode("latin-1")
        self.grant = self.decider.auth.grant_for(authorization)

    def _read(self, body: bytes) -> Decision:
        """The request's decision (the shared core's).

        Raises:
            APIError: 413 a body too large, 403 a tier its key may not use.
        """
        assert self.grant is not None, "the headers came first"
        limit = self.decider.config.max_request_body_bytes
        if len(body) > limit:
            raise APIError(413, f"the request body is over {limit} bytes")
        method = self.headers.get(":method", "POST")
        return self.decider.decide(method, self.grant, self.headers, body)

    def _pick(self, ranking: Ranking, phase: str) -> pb.ProcessingResponse:
        """The answer naming ``ranking``'s first ``--destination-endpoints`` endpoints; the
        pick's in-flight attempt begins."""
        config = self.decider.config
        chosen = ranking.backends[: config.destination_endpoints]
        self.picked = chosen[0]
        self.attempt = self.decider.pool.begin_attempt(chosen[0])
        destination = ",".join(endpoint_of(b) for b in chosen)
        common = pb.CommonResponse(
            header_mutation=self._mutation(destination), clear_route_cache=True
        )
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: destination}})
        if phase == "request_headers":
            return pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
            )
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
        )

    def _mutation(self, destination: str) -> pb.HeaderMutation:
        """What the proxy does to a request's headers, and the destination header."""
        auth = self.decider.auth
        assert self.grant is not None
        set_headers = {DESTINATION: destination}
        remove = []
        trusted = auth.trusted_headers(self.grant)
        if trusted is not None:  # the key's tenant and tiers replace the client's
            remove += [h for h in TRUSTED_HEADERS if h in self.headers and h not in trusted]
            set_headers |= trusted
        upstream = auth.upstream_authorization()
        if upstream is not None:
            set_headers["authorization"] = upstream
        elif "authorization" in self.headers:  # the client's key never goes on
            remove.append("authorization")
        return pb.HeaderMutation(
            set_headers=[_header(k, v) for k, v in set_headers.items()], remove_headers=remove
        )

    def _served(self, headers: pb.HttpHeaders) -> None:
        """Count the answer's status by the replica the gateway reports serving it."""
        values = {
            h.key.lower(): h.raw_value.decode("latin-1") or h.value for h in headers.headers.headers
        }
        served = values.get(SERVED, "").split(",")[0].strip()
        status = values.get(":status", "")
        backend = next(
            (b for b in self.decider.pool.backends.values() if endpoint_of(b) == served), None
        )
        metrics = self.picker.metrics
        name = backend.name if backend is not None else (self.picked.name if self.picked else "")
        if served:
            picked = self.picked is not None and endpoint_of(self.picked) == served
            metrics.served.labels(replica=name, picked=str(picked).lower()).inc()
        if name and status:
            metrics.requests.labels(replica=name, code=status).inc()

    def close(self) -> None:
        """The stream is over: the pick's attempt ends."""
        if self.attempt is not None:
            self.decider.pool.end_attempt(self.attempt)
            self.attempt = None


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode("utf-8")),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _immediate(error: APIError) -> pb.ProcessingResponse:
    """``error`` as the gateway's answer to the client, in OpenAI's shape."""
    headers = {"content-type": "application/json", **error.headers}
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=pb.HeaderMutation(set_headers=[_header(k, v) for k, v in headers.items()]),
            body=json.dumps(error.body()).encode(),
            details=f"{PICKER_DETAILS_PREFIX}{error.status}",
        )
    )


def _subset_hint(message: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway allows (filter metadata ``envoy.lb.subset_hint``), or None
    for no hint (every replica)."""
    metadata = message.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in metadata:
        return None
    values = metadata[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if values is None:
        return None
    return [v.string_value for v in values.list_value.values if v.string_value]
