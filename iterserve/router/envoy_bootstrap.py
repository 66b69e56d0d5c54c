"""An Envoy bootstrap that puts a gateway in front of the endpoint picker
(:mod:`iterserve.router.epp`): the one source of the configuration docs/gateway.md shows,
``iterserve router envoy-config`` prints and the tests run. Data (dicts), YAML at the edge.

::

    client -> listener (HTTP/1.1, h2c)
              -> header_mutation: drop a client's own x-gateway-destination-endpoint
              -> ext_proc (gRPC to the picker): request headers, request body BUFFERED,
                 response headers; FailClose (503) or FailOpen when the picker is down
              -> router: route "/" to the pool cluster, no route timeout (streams), retries on
                 connect failures and resets before the response began, the endpoint that
                 served written back as x-gateway-destination-endpoint-served
              -> cluster "inference_pool":
                   ORIGINAL_DST on the x-gateway-destination-endpoint header (GAIE's reference
                   configuration; the header must hold one endpoint: the picker's
                   --destination-endpoints 1), or
                   the pool's endpoints listed, picked by Envoy's override_host policy from
                   the same header (the ordered list: a retry goes to the next endpoint;
                   without the header, as in FailOpen, round robin over the endpoints)

Decision: retries happen in Envoy, not in the picker: ext_proc runs once per request, so a
refused connection is retried on the next endpoint of the list the picker answered (with
``override_host``); with ORIGINAL_DST the retry goes to the same endpoint, and a dead replica
is avoided once the picker's polls eject it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import yaml

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
# The picker's ImmediateResponses carry this details prefix; Envoy's local-reply mappers
# leave those answers as the picker wrote them (they are in OpenAI's shape already).
PICKER_DETAILS_PREFIX = "iterserve_picker_"
_TYPES = "type.googleapis.com/envoy.extensions."


@dataclass(frozen=True)
class Address:
    """A ``host:port`` Envoy listens on or connects to."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        """``HOST:PORT`` (``[v6]:PORT``).

        Raises:
            ValueError: not of that shape.
        """
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def socket(self) -> dict[str, Any]:
        return {"socket_address": {"address": self.host, "port_value": self.port}}


@dataclass(frozen=True)
class GatewaySettings:
    """What the bootstrap is made of.

    Args:
        listen: where clients connect.
        epp: the picker's ext_proc gRPC address (``--grpc-port``).
        admin: Envoy's admin interface (port 0: any free port).
        endpoints: the pool's ``ip:port`` endpoints for an ``override_host`` cluster (the
            ordered fallback list honoured); empty: an ORIGINAL_DST cluster.
        failure_mode_allow: FailOpen (the request goes on without a pick when the picker
            cannot be reached) instead of FailClose (503).
        max_request_body_bytes: the body Envoy buffers for the picker (the listener's
            buffer limit; larger ones get 413 from Envoy).
        hold_timeout_s: the picker's ``--hold-timeout-s``: the longest Envoy lets it take to
            answer (``max_message_timeout``; each answer otherwise within ``message_timeout_s``).
        num_retries: attempts after the first, each on the next endpoint of the list.
    """

    listen: Address
    epp: Address
    admin: Address = Address("127.0.0.1", 0)
    endpoints: tuple[str, ...] = ()
    failure_mode_allow: bool = False
    max_request_body_bytes: int = 4 << 20
    hold_timeout_s: float = 60.0
    message_timeout_s: float = 2.0
    num_retries: int = 2


def bootstrap(s: GatewaySettings) -> dict[str, Any]:
    """The Envoy bootstrap (module docstring) as a dict."""
    return {
        "admin": {"address": s.admin.socket()},
        "static_resources": {
            "listeners": [_listener(s)],
            "clusters": [_epp_cluster(s), _pool_cluster(s)],
        },
    }


def bootstrap_yaml(s: GatewaySettings) -> str:
    return yaml.safe_dump(bootstrap(s), sort_keys=False)


def _listener(s: GatewaySettings) -> dict[str, Any]:
    route = {
        "cluster": "inference_pool",
        "timeout": "0s",  # a generation streams for as long as it takes
        "retry_policy": {"retry_on": "connect-failure,reset", "num_retries": s.num_retries},
    }
    served = {"header": {"key": SERVED, "value": "%UPSTREAM_HOST%"}}
    hcm = {
        "@type": _TYPES + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "inference_pool",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": route},
                    ],
                    "response_headers_to_add": [served],
                }
            ]
        },
        "http_filters": [_strip_destination(), _ext_proc(s), _router()],
        "local_reply_config": _local_replies(s),
    }
    return {
        "name": "gateway",
        "address": s.listen.socket(),
        "per_connection_buffer_limit_bytes": s.max_request_body_bytes,
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def _local_replies(s: GatewaySettings) -> dict[str, Any]:
    """Envoy's own answers (a body over its buffer: 413; the picker unreachable in FailClose,
    no healthy upstream: 503; ...) in OpenAI's error shape, as the picker's and the replicas'
    are, with ``Retry-After`` on a 503; the picker's own answers are left as they are.

    Decision: a CEL filter on the response's details tells the picker's ImmediateResponses
    (:data:`PICKER_DETAILS_PREFIX`) from Envoy's; a status filter alone would rewrite the
    picker's 503s and 413s too (their codes and messages lost)."""

    def details(expression: str) -> dict[str, Any]:
        return {
            "extension_filter": {
                "name": "envoy.access_loggers.extension_filters.cel",
                "typed_config": {
                    "@type": _TYPES + "access_loggers.filters.cel.v3.ExpressionFilter",
                    "expression": expression,
                },
            }
        }

    not_picker = details(f"!response.code_details.startsWith('{PICKER_DETAILS_PREFIX}')")

    def mapper(
        status: int | None, message: str, kind: str, match: dict[str, Any] = not_picker
    ) -> dict[str, Any]:
        error = {"message": message, "type": kind, "param": None, "code": None}
        if status is not None:
            code = {"op": "EQ", "value": {"default_value": status, "runtime_key": "unused"}}
            status_filter = {"status_code_filter": {"comparison": code}}
            match = {"and_filter": {"filters": [match, status_filter]}}
        out: dict[str, Any] = {
            "filter": match,
            "body_format_override": {"json_format": {"error": error}},
        }
        if status == 503:
            retry = {"header": {"key": "retry-after", "value": "1"}}
            out["headers_to_add"] = [{**retry, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
        return out

    why = "%RESPONSE_CODE_DETAILS%"
    return {
        "mappers": [
            mapper(
                413,
                f"the request body is over {s.max_request_body_bytes} bytes",
                "invalid_request_error",
            ),
            mapper(  # FailClose: the picker down, or not answering in time
                503,
                f"the endpoint picker did not answer ({why}); retry later",
                "service_unavailable_error",
                details("response.code_details.startsWith('ext_proc_error')"),
            ),
            mapper(
                503,
                f"the gateway cannot serve the request now ({why}); retry later",
                "service_unavailable_error",
            ),
            mapper(None, f"the gateway answered %RESPONSE_CODE% ({why})", "api_error"),
        ]
    }


def _strip_destination() -> dict[str, Any]:
    """A client's own destination header must not choose the replica (FailOpen)."""
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _TYPES + "filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DESTINATION}]},
        },
    }


def _ext_proc(s: GatewaySettings) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _TYPES + "filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
            "failure_mode_allow": s.failure_mode_allow,
            # FailClose: the picker unreachable (or failing) is a 503, as the protocol's
            # "no endpoint" (Envoy's default would be a 500).
            "status_on_error": {"code": 503},
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",  # the answer streams past the picker
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
            "message_timeout": _seconds(s.message_timeout_s),
            # A request held for a replica to turn ready (scale from zero) is answered late:
            # the picker asks for more time with override_message_timeout, up to this.
            "max_message_timeout": _seconds(s.hold_timeout_s + 10),
            "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}},
        },
    }


def _router() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": _TYPES + "filters.http.router.v3.Router"},
    }


def _epp_cluster(s: GatewaySettings) -> dict[str, Any]:
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _TYPES + "upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    return {
        "name": "epp",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": http2,
        "load_assignment": {
            "cluster_name": "epp",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": s.epp.socket()}}]}],
        },
    }


def _pool_cluster(s: GatewaySettings) -> dict[str, Any]:
    if not s.endpoints:
        return {
            "name": "inference_pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    endpoints = [{"endpoint": {"address": Address.parse(e).socket()}} for e in s.endpoints]
    round_robin = {
        "name": "envoy.load_balancing_policies.round_robin",
        "typed_config": {"@type": _TYPES + "load_balancing_policies.round_robin.v3.RoundRobin"},
    }
    override_host = {
        "@type": _TYPES + "load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [{"header": DESTINATION}],
        "fallback_policy": {"policies": [{"typed_extension_config": round_robin}]},
    }
    return {
        "name": "inference_pool",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": "inference_pool",
            "endpoints": [{"lb_endpoints": endpoints}],
        },
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": override_host,
                    }
                }
            ]
        },
    }


def _seconds(value: float) -> str:
    return f"{value:g}s"


def print_config(args: argparse.Namespace) -> int:
    """``iterserve router envoy-config``: the bootstrap of its flags on stdout; 2 with the
    reason on a bad flag."""
    try:
        settings = GatewaySettings(
            listen=Address.parse(args.listen),
            epp=Address.parse(args.epp),
            admin=Address.parse(args.admin),
            endpoints=tuple(str(Address.parse(e)) for e in args.endpoint),
            failure_mode_allow=args.fail_open,
            max_request_body_bytes=args.max_request_body_bytes,
            hold_timeout_s=args.hold_timeout_s,
        )
    except ValueError as e:
        print(f"iterserve router envoy-config: error: {e}", file=sys.stderr)
        return 2
    print(bootstrap_yaml(settings), end="")
    return 0
