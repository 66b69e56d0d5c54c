"""What the schema lets through but the API server or ``iterserve serve`` would refuse,
refused before anything is applied (:class:`SpecError`, ``Ready=False``, and ``iterserve
operator render`` exits 1): names that cannot carry the owned objects' names, label keys and
values, environment entries and images Kubernetes rejects, and server arguments the server's
own parser and config classes reject or that undo what the operator sets.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
from typing import Any

from iterserve.operator.spec import LLMDeploymentSpec, SpecError

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_1123_LABEL = re.compile(_DNS_LABEL)
DNS_1123_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
# The longest suffix the operator adds to a name that must be a DNS-1035 label (Services).
_SERVICE_SUFFIX = "-router"
MAX_NAME = 63 - len(_SERVICE_SUFFIX)
# What the operator sets in the server container's environment (POD_NAME: the KV-events
# topic's pod).
OPERATOR_ENV = ("ITERSERVE_ADMIN_TOKEN", "ITERSERVE_API_KEY", "XDG_CACHE_HOME", "POD_NAME")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_AFFINITY_KEYS = {"nodeAffinity", "podAffinity", "podAntiAffinity"}
# Server flags the operator sets through other means than its arguments: the secrets come
# from the environment, the live settings from spec.scheduler and spec.slaTiers.
_RESERVED_DESTS = {
    "admin_token": "the admin-token Secret",
    "admin_token_file": "the admin-token Secret's volume",
    "admin_port": "the admin port the operator pushes to",
    "api_key": "the API-key Secret",
    "api_keys_file": "spec.auth.apiKeysSecret",
    "router_token_file": "the router-token Secret",
}


def check_name(name: Any, namespace: Any) -> None:
    """The resource's name and namespace can carry every owned object's name and labels:
    Services ``N-server`` and ``N-router`` are DNS-1035 labels (a lowercase letter first, at
    most 63 characters), the label ``app.kubernetes.io/instance: N`` at most 63; ``N`` does
    not end in ``-router`` or ``-epp`` (another resource's router or picker Deployment has
    that name)."""
    if not isinstance(name, str) or not DNS_1035_LABEL.fullmatch(name) or len(name) > MAX_NAME:
        raise SpecError(
            f"metadata.name {name!r}: must be a lowercase letter followed by lowercase letters, "
            f"digits or '-' (not ending in '-'), at most {MAX_NAME} characters, so that the "
            f"Services {name}-server and {name}-router are valid DNS-1035 labels"
        )
    if (
        not isinstance(namespace, str)
        or not DNS_1123_LABEL.fullmatch(namespace)
        or len(namespace) > 63
    ):
        raise SpecError(f"metadata.namespace {namespace!r}: not a valid namespace name")
    for suffix, what in (("-router", "router"), ("-epp", "endpoint picker")):
        if name.endswith(suffix):
            raise SpecError(
                f"metadata.name {name!r}: must not end in '{suffix}': the {what} Deployment of "
                f"{name.removesuffix(suffix)!r} has that name (and its pods that prefix)"
            )


def _qualified_name(key: str) -> bool:
    """A label or annotation key: ``[prefix/]name`` (prefix a DNS subdomain)."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not DNS_1123_SUBDOMAIN.fullmatch(prefix)):
        return False
    return len(name) <= 63 and bool(_NAME_PART.fullmatch(name))


def _label_value(value: str) -> bool:
    return value == "" or (len(value) <= 63 and bool(_NAME_PART.fullmatch(value)))


def _image(where: str, image: str | None) -> None:
    if image is not None and image != image.strip():
        raise SpecError(f"{where}: an image must not have leading or trailing whitespace")


def check_objects_fields(spec: LLMDeploymentSpec) -> None:
    """The pass-through fields, as the API server validates them (the parts the schema
    leaves open)."""
    p = spec.pod
    for where, mapping, values_are_labels in (
        ("spec.pod.labels", p.labels, True),
        ("spec.pod.nodeSelector", p.nodeSelector, True),
        ("spec.pod.annotations", p.annotations, False),
    ):
        for key, value in mapping.items():
            if not _qualified_name(key):
                raise SpecError(
                    f"{where}: key {key!r} is not a valid qualified name ([prefix/]name, name "
                    "at most 63 alphanumerics, '-', '_' or '.', starting and ending "
                    "alphanumeric)"
                )
            if values_are_labels and not _label_value(value):
                raise SpecError(
                    f"{where}[{key!r}]: value {value!r} is not a valid label value (at most 63 "
                    "alphanumerics, '-', '_' or '.', starting and ending alphanumeric)"
                )
    names = set()
    for i, entry in enumerate(p.env):
        where = f"spec.pod.env[{i}]"
        name = entry.get("name")
        if not isinstance(name, str) or not name or not re.fullmatch(r"[ -<>-~]+", name):
            raise SpecError(f"{where}: name must be printable ASCII other than '=', got {name!r}")
        if name in OPERATOR_ENV:
            raise SpecError(f"{where}: {name} is set by the operator")
        if name in names:
            raise SpecError(f"{where}: {name} is given twice")
        names.add(name)
        if unknown := sorted(set(entry) - {"name", "value", "valueFrom"}):
            raise SpecError(f"{where}: unknown keys {unknown} (name, value, valueFrom)")
        if "value" in entry and not isinstance(entry["value"], str):
            raise SpecError(f"{where}: value must be a string, got {entry['value']!r}")
        if "valueFrom" in entry and ("value" in entry or not isinstance(entry["valueFrom"], dict)):
            raise SpecError(f"{where}: valueFrom is a mapping, and excludes value")
    for i, toleration in enumerate(p.tolerations):
        if unknown := sorted(set(toleration) - _TOLERATION_KEYS):
            raise SpecError(f"spec.pod.tolerations[{i}]: unknown keys {unknown}")
    if unknown := sorted(set(p.affinity) - _AFFINITY_KEYS):
        raise SpecError(f"spec.pod.affinity: unknown keys {unknown}")
    for i, secret in enumerate(p.imagePullSecrets):
        if set(secret) != {"name"} or not isinstance(secret["name"], str):
            raise SpecError(f"spec.pod.imagePullSecrets[{i}]: expected {{name: SECRET}}")
    source = spec.model.source
    if source.pvc is not None and (
        len(source.pvc.claimName) > 253 or not DNS_1123_SUBDOMAIN.fullmatch(source.pvc.claimName)
    ):
        raise SpecError(
            f"spec.model.source.pvc.claimName {source.pvc.claimName!r}: not a valid claim name"
        )
    if source.hostPath is not None and ".." in source.hostPath.split("/"):
        raise SpecError("spec.model.source.hostPath: must not contain '..'")
    for where, value in (
        ("spec.model.name", spec.model.name),
        ("spec.model.source.image.path", source.image.path if source.image else ""),
    ):
        if value.startswith("-"):
            raise SpecError(f"{where}: must not start with '-' (it is a server argument)")
    if spec.resources.gpus == 0 and spec.tensor_parallel_size > 1:
        raise SpecError(
            "spec.tensorParallelSize above 1 needs resources.gpus (CPU pods run one shard)"
        )
    _image("spec.image", spec.image)
    _image("spec.model.source.initImage", source.initImage)
    _image("spec.router.image", spec.router.image)


def check_server_args(spec: LLMDeploymentSpec, args: list[str], settings: dict[str, Any]) -> None:
    """The server container's arguments (``args``, ending with ``spec.pod.extraArgs``) as
    ``iterserve serve`` reads them: its own parser, then its config classes over the
    ConfigMap's ``settings``. Refused: what the parser or the classes refuse, and extra
    arguments that change a flag the operator sets (``--port`` would leave the probes and the
    push on a port nothing listens on) or that the spec sets elsewhere (the live settings,
    the secrets)."""
    from iterserve.config import (
        ENGINE_CONFIG_CLASSES,
        LIVE_SCHEDULER_KEYS,
        ConfigError,
        EngineConfig,
        ServerConfig,
        SimulationConfig,
    )

    parser = serve_parser()
    serve = _subparser(parser, "serve")
    extra = list(spec.pod.extraArgs)
    own = args[: len(args) - len(extra)] if extra else args
    base, with_extra = _parse(parser, own), _parse(parser, args)
    operator_dests = {
        serve._option_string_actions[a].dest
        for a in own
        if a.startswith("--") and a in serve._option_string_actions
    }
    for dest in sorted(set(vars(with_extra)) | set(vars(base))):
        value = getattr(with_extra, dest, None)
        if value == getattr(base, dest, None):
            continue
        flag = "--" + dest.replace("_", "-")
        if dest in operator_dests or dest in ("config", "config_version", "max_model_len"):
            raise SpecError(f"spec.pod.extraArgs: {flag} is set by the operator")
        if dest in LIVE_SCHEDULER_KEYS:
            raise SpecError(
                f"spec.pod.extraArgs: {flag} is a live setting: set it in spec.scheduler or "
                "spec.slaTiers (pushed to the pods without a restart)"
            )
        if dest in _RESERVED_DESTS:
            raise SpecError(f"spec.pod.extraArgs: {flag} comes from {_RESERVED_DESTS[dest]}")
    classes = (*ENGINE_CONFIG_CLASSES, ServerConfig, SimulationConfig)
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    kwargs = {**settings, **{k: v for k, v in vars(with_extra).items() if k in known}}
    try:
        ServerConfig(**_pop(kwargs, ServerConfig))
        SimulationConfig(**_pop(kwargs, SimulationConfig))
        EngineConfig.from_kwargs(**kwargs)
    except (ConfigError, TypeError, ValueError) as e:
        raise SpecError(f"iterserve serve would refuse its configuration: {e}") from e


def serve_parser() -> argparse.ArgumentParser:
    """``iterserve serve``'s parser, built by the CLI's own :func:`add_engine_flags` (the
    control plane does not import the CLI, which reaches the engine), except that
    ``--tiers`` takes its file name as a string: the operator reads no file for a spec."""
    from iterserve.config import ENGINE_CONFIG_CLASSES, ServerConfig, SimulationConfig
    from iterserve.engine_flags import add_engine_flags

    parser = argparse.ArgumentParser(prog="iterserve")
    serve = parser.add_subparsers(dest="command", required=True).add_parser("serve")
    add_engine_flags(serve, (ServerConfig, *ENGINE_CONFIG_CLASSES, SimulationConfig), tiers=str)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise LookupError(name)


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(args)
    except SystemExit as e:
        lines = stderr.getvalue().strip().splitlines()[-1:] or [str(e)]
        message = re.sub(r"^iterserve( serve)?: error: ", "", lines[0])
        raise SpecError(f"iterserve serve would refuse its arguments: {message}") from None


def _pop(kwargs: dict[str, Any], cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: kwargs.pop(k) for k in list(kwargs) if k in names}
