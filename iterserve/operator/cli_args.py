"""Flags of ``iterserve operator`` (argparse only: building the parser loads nothing else)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from importlib.metadata import version

# The control image of this version (the Dockerfile's `control` target, tagged
# <version>-control): the routers' default, as the chart's. (The installed distribution's
# version: importing `iterserve` for its __version__ would cross the layering contracts.)
DEFAULT_CONTROL_IMAGE = f"ghcr.io/iterserve/iterserve:{version('iterserve')}-control"
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_operator_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="operator_command", required=True)
    run = sub.add_parser(
        "run",
        help="reconcile LLMDeployments (kopf)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable; default: all namespaces)",
    )
    run.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG, ~/.kube/config, "
                     "or the pod's ServiceAccount")  # fmt: skip
    run.add_argument(
        "--control-image",
        default=DEFAULT_CONTROL_IMAGE,
        help="the router's image when spec.router.image is not set",
    )
    run.add_argument(
        "--push-timeout-s", type=float, default=5.0, help="per pod, for /load and the PUT"
    )
    run.add_argument(
        "--resync-interval-s",
        type=float,
        default=10.0,
        help="reconcile every resource this often (drift, pods that missed a push)",
    )
    run.add_argument(
        "--standalone", action="store_true", help="no kopf peering (a single operator for sure)"
    )
    _add_endpoint_args(run)
    run.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="debug also logs kopf's own internals (every watch event and patch)",
    )
    render = sub.add_parser(
        "render",
        help="print every object the operator would create for an LLMDeployment (no cluster; "
        "not the Secrets N-admin, N-api-key and N-router-token, which it creates with random "
        "values when "
        "absent, nor owner references)",
    )
    render.add_argument("file", help="an LLMDeployment YAML file")
    render.add_argument(
        "-n",
        "--namespace",
        default=None,
        help="the namespace of documents that name none (default: default), as kubectl "
        "apply -n; a document in another namespace is an error",
    )
    render.add_argument(
        "--control-image", default=DEFAULT_CONTROL_IMAGE, help="the router's default image"
    )


def _port(lowest: int) -> Callable[[str], int]:
    """An argparse type: a TCP port, ``lowest`` to 65535."""

    def port(text: str) -> int:
        value = int(text)
        if not lowest <= value <= 65535:
            raise argparse.ArgumentTypeError(f"a port is {lowest} to 65535, got {value}")
        return value

    return port


def _add_endpoint_args(run: argparse.ArgumentParser) -> None:
    """Where the operator listens (/healthz, /metrics) and who it is (its NetworkPolicies)."""
    run.add_argument(
        "--liveness-port", type=_port(1), default=8081, help="/healthz for the kubelet"
    )
    run.add_argument(
        "--liveness-host",
        default="0.0.0.0",
        help="address /healthz listens on (the chart passes the pod's IP)",
    )
    run.add_argument(
        "--metrics-port",
        type=_port(0),
        default=8082,
        help="the operator's own Prometheus /metrics, on --liveness-host (0: not served)",
    )
    run.add_argument(
        "--operator-namespace",
        default=None,
        help="the namespace of the operator's own pods: the NetworkPolicies let only pods "
        "there (with the --operator-label labels) reach the server pods' admin port "
        "(default: any namespace)",
    )
    run.add_argument(
        "--operator-label",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a label of the operator's own pods (repeatable; default: "
        "app.kubernetes.io/name=iterserve and app.kubernetes.io/component=operator, as the "
        "chart labels them)",
    )
