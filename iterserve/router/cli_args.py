"""Flags of ``iterserve router`` (argparse only: building the parser loads nothing else)."""

from __future__ import annotations

import argparse

from iterserve.router.scoring import POLICIES

_BACKEND_TYPES = ("auto", "iterserve", "vllm", "sglang")


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL, e.g. http://10.0.0.5:8000 (repeatable)",
    )
    p.add_argument(
        "--backend-type",
        choices=_BACKEND_TYPES,
        default="auto",
        help="how replicas report load: iterserve /load, or vLLM / SGLang /metrics "
        "(auto: detected per replica)",
    )
    p.add_argument("--k8s-service", default=None, help="discover replicas from this Service")
    p.add_argument("--namespace", default="default", help="the Service's namespace")
    p.add_argument("--k8s-port-name", default="http", help="the EndpointSlice port to use")
    p.add_argument("--policy", choices=POLICIES, default="least_kv", help="how replicas are picked")
    p.add_argument(
        "--session-header", default="x-session-id", help="policy session: the sticky header"
    )
    p.set_defaults(prefix_affinity=True)  # before the flag: its own default stays SUPPRESS
    p.add_argument(
        "--no-prefix-affinity",
        dest="prefix_affinity",
        action="store_false",
        default=argparse.SUPPRESS,  # no "(default: True)" in --help: affinity is on
        help="least_kv without prefix affinity (on by default)",
    )
    p.add_argument("--poll-interval-ms", type=float, default=50.0, help="load polls per replica")
    p.add_argument("--poll-timeout-ms", type=float, default=400.0, help="(below --stale-after-ms)")
    p.add_argument(
        "--stale-after-ms", type=float, default=500.0, help="older reports score as saturated"
    )
    p.add_argument("--eject-after", type=int, default=3, help="consecutive failures that eject")
    p.add_argument("--connect-timeout-s", type=float, default=2.0, help="to a replica")
    p.add_argument(
        "--first-byte-timeout-s",
        type=float,
        default=300.0,
        help="until a replica's response headers (non-streamed answers come whole)",
    )
    p.add_argument("--read-timeout-s", type=float, default=600.0, help="between stream chunks")
    p.add_argument(
        "--max-request-body-bytes", type=int, default=4 << 20, help="larger bodies get 413"
    )
    p.add_argument(
        "--shutdown-grace-period-s",
        type=float,
        default=30.0,
        help="after SIGTERM: /ready 503, open requests served for up to this long",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="TCP port")
    p.add_argument(
        "--api-key", default=None, help="Bearer key clients must send (env ITERSERVE_API_KEY)"
    )
    p.add_argument(
        "--backend-api-key",
        default=None,
        help="the key the replicas expect; clients' own keys are not forwarded "
        "(env ITERSERVE_BACKEND_API_KEY)",
    )
