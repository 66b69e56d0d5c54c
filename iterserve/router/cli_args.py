"""Flags of ``iterserve router``, one per :class:`~iterserve.router.config.RouterConfig`
field, with its default (argparse only: building the parser loads nothing else)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from iterserve.router.config import RouterConfig


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    hints = typing.get_type_hints(RouterConfig)
    for f in dataclasses.fields(RouterConfig):
        help_text = f.metadata["help"]
        if f.metadata.get("negative_flag"):
            p.set_defaults(**{f.name: f.default})  # before the flag: its default stays SUPPRESS
            p.add_argument(
                "--no-" + f.name.replace("_", "-"),
                dest=f.name,
                action="store_false",
                default=argparse.SUPPRESS,  # no "(default: True)" in --help: the text says it
                help=help_text,
            )
            continue
        kwargs: dict[str, Any] = {"default": f.default, "help": help_text}
        if "metavar" in f.metadata:
            kwargs["metavar"] = f.metadata["metavar"]
        tp = _unwrap_optional(hints[f.name])
        if typing.get_origin(tp) is tuple:  # repeatable; RouterConfig.from_args makes a tuple
            kwargs.update(action="append", default=list(kwargs["default"]))
        elif typing.get_origin(tp) is typing.Literal:
            kwargs["choices"] = typing.get_args(tp)
        elif "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        else:
            kwargs["type"] = tp
        p.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def add_router_subcommands(p: argparse.ArgumentParser) -> None:
    """``iterserve router envoy-config``: print an Envoy bootstrap in front of the endpoint
    picker (:mod:`iterserve.router.envoy_bootstrap`, docs/gateway.md)."""
    sub = p.add_subparsers(dest="router_command", required=False, metavar="{envoy-config}")
    e = sub.add_parser(
        "envoy-config",
        help="print an Envoy bootstrap: a gateway in front of the endpoint picker",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e.add_argument("--epp", required=True, metavar="HOST:PORT", help="the picker's --grpc-port")
    e.add_argument("--listen", default="0.0.0.0:8081", metavar="HOST:PORT", help="for clients")
    e.add_argument("--admin", default="127.0.0.1:9901", metavar="HOST:PORT", help="Envoy's admin")
    e.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="IP:PORT",
        help="a replica (repeatable): an override_host cluster over them, the picker's "
        "fallback list honoured; none: an ORIGINAL_DST cluster (picker: "
        "--destination-endpoints 1)",
    )
    e.add_argument(
        "--fail-open", action="store_true", help="go on without a pick when the picker is down"
    )
    e.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 << 20,
        help="Envoy buffers the body for the picker up to this (the picker's own limit)",
    )
    e.add_argument(
        "--hold-timeout-s",
        type=float,
        default=60.0,
        help="the picker's: Envoy waits this long plus a margin for a held request's pick",
    )


def _unwrap_optional(tp: Any) -> Any:
    """``X | None`` -> ``X``; any other type as is."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    return tp
