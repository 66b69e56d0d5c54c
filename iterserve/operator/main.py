"""``iterserve operator run`` (kopf, the handlers of :mod:`iterserve.operator.handlers`) and
``iterserve operator render FILE`` (the builders alone)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

from iterserve.operator.builders import Context, build_all
from iterserve.operator.spec import KIND, SpecError, parse_spec

API_VERSION = "iterserve.io/v1alpha1"
# kopf's peering object (the chart ships it): a second operator pauses instead of acting.
PEERING_NAME = "iterserve"


def render(document: Any, control_image: str, namespace: str | None = None) -> list[dict[str, Any]]:
    """The objects for one LLMDeployment document, in render order (ConfigMap, Services,
    Deployments, RBAC, PDB, autoscaler), in the document's namespace, else ``namespace``, else
    ``default`` (as ``kubectl apply -n``).

    Raises:
        SpecError: not an LLMDeployment, an invalid spec, or a document whose namespace is
            not ``namespace``.
    """
    if not isinstance(document, dict) or document.get("kind") != KIND:
        raise SpecError(f"expected kind: {KIND}")
    if document.get("apiVersion") != API_VERSION:
        raise SpecError(f"expected apiVersion: {API_VERSION}")
    meta = document.get("metadata") or {}
    if not isinstance(meta, dict):
        raise SpecError("metadata: expected a mapping")
    if not meta.get("name"):
        raise SpecError("metadata.name is required")
    generation = meta.get("generation") or 1
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise SpecError(f"metadata.generation: expected a positive integer, got {generation!r}")
    if not isinstance(document.get("spec"), dict):
        raise SpecError("spec: expected a mapping")
    spec = parse_spec(document["spec"])
    if namespace and meta.get("namespace") not in (None, "", namespace):
        raise SpecError(
            f"{meta['name']} is in namespace {meta['namespace']}, not --namespace {namespace}"
        )
    where = meta.get("namespace") or namespace or "default"
    return build_all(Context(meta["name"], where, generation, control_image), spec)


def _render(args: argparse.Namespace) -> int:
    try:
        documents = [d for d in yaml.safe_load_all(Path(args.file).read_text()) if d is not None]
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        print(f"iterserve operator render: error: {e}", file=sys.stderr)
        return 1
    if not documents:
        print(f"iterserve operator render: {args.file}: no LLMDeployment in it", file=sys.stderr)
        return 1
    objects: list[dict[str, Any]] = []
    seen: set[tuple[Any, Any]] = set()
    for document in documents:
        try:
            rendered = render(document, args.control_image, args.namespace)
            meta = document["metadata"]
            key = (rendered[0]["metadata"]["namespace"], meta["name"])
            if key in seen:
                raise SpecError(f"two LLMDeployments named {key[1]} in namespace {key[0]}")
            seen.add(key)
            objects += rendered
        except SpecError as e:
            print(f"iterserve operator render: invalid {args.file}: {e}", file=sys.stderr)
            return 1
    sys.stdout.write(yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False))
    return 0


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's settings file) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def configure_logging(level: str) -> None:
    """kopf's log format at ``level`` (one of ``cli_args.LOG_LEVELS``): ``debug`` includes
    kopf's internals, ``warning`` and ``error`` leave out the handlers' progress."""
    import logging

    import kopf

    kopf.configure(debug=level == "debug")  # sets the root logger to DEBUG or INFO
    logging.getLogger().setLevel(level.upper())


def peering_options(standalone: bool) -> dict[str, Any]:
    """kopf's peering arguments: peering through :data:`PEERING_NAME`, or none at all.

    kopf makes peering mandatory whenever it is given a peering name, ``standalone=True``
    included, and mandatory peering with no peering resource to watch (standalone watches
    none) pauses the operator for good ("peering CRD is missing"): standalone gets no name.
    """
    if standalone:
        return {"standalone": True}
    return {"standalone": False, "peering_name": PEERING_NAME}


def _run(args: argparse.Namespace) -> int:
    if args.metrics_port == args.liveness_port:
        print(
            f"iterserve operator run: --metrics-port {args.metrics_port} must differ from "
            "--liveness-port (each is its own listener)",
            file=sys.stderr,
        )
        return 2
    import kopf

    from iterserve.operator.handlers import build_registry
    from iterserve.operator.metrics import OperatorMetrics
    from iterserve.operator.reconcile import OperatorSettings

    settings = OperatorSettings(args.control_image, args.push_timeout_s, tuple(args.namespace))
    if args.operator_namespace:
        settings = dataclasses.replace(settings, operator_namespace=args.operator_namespace)
    if args.operator_label:
        labels = tuple(_label(item) for item in args.operator_label)
        settings = dataclasses.replace(settings, operator_labels=labels)
    metrics = OperatorMetrics()
    memo = kopf.Memo(kubeconfig=args.kubeconfig, settings=settings, metrics=metrics)
    configure_logging(args.log_level)
    if args.metrics_port:
        metrics.serve(args.liveness_host, args.metrics_port)
    kopf.run(
        registry=build_registry(args.resync_interval_s),
        **peering_options(args.standalone),
        namespaces=args.namespace,
        clusterwide=not args.namespace,
        memo=memo,
        liveness_endpoint=f"http://{_url_host(args.liveness_host)}:{args.liveness_port}/healthz",
    )
    return 0


def _label(item: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--operator-label`` (SystemExit 2 otherwise, as argparse's errors)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        print(f"iterserve operator run: --operator-label {item!r}: expected KEY=VALUE",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return key, value


def _url_host(host: str) -> str:
    """A host as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def main(args: argparse.Namespace) -> int:
    if args.operator_command == "render":
        return _render(args)
    return _run(args)
