"""The router's settings: one frozen dataclass, whose fields are ``iterserve router``'s flags
(:mod:`iterserve.router.cli_args` derives them: the defaults live here only).

Standard library and :mod:`iterserve.router.scoring` only: building the CLI parser loads
nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import urllib.parse
from dataclasses import dataclass, field
from typing import Literal

from iterserve import envs
from iterserve.router.scoring import POLICIES

BackendType = Literal["auto", "iterserve", "vllm", "sglang"]
Mode = Literal["proxy", "endpoint-picker"]

# Flags that must be positive and finite.
_POSITIVE = (
    "poll_interval_ms", "poll_timeout_ms", "stale_after_ms", "connect_timeout_s",
    "first_byte_timeout_s", "read_timeout_s", "max_request_body_bytes",
    "shutdown_grace_period_s",
)  # fmt: skip


@dataclass(frozen=True)
class RouterConfig:
    """Everything ``iterserve router`` is told (field ``x_y`` is flag ``--x-y``).

    Field metadata: ``help``; ``metavar``; ``choices``; ``negative_flag`` (a flag
    ``--no-x-y`` turns the field off, and the field has no flag of its own).

    Raises:
        ValueError: inconsistent settings (message naming the flag).
    """

    backend: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "a replica's base URL, e.g. http://10.0.0.5:8000 (repeatable)",
            "metavar": "URL",
        },
    )
    backend_type: BackendType = field(
        default="auto",
        metadata={
            "help": "how replicas report load: iterserve /load, or vLLM / SGLang "
            "/metrics (auto: detected per replica)"
        },
    )
    k8s_service: str | None = field(
        default=None, metadata={"help": "discover replicas from this Service"}
    )
    namespace: str = field(default="default", metadata={"help": "the Service's namespace"})
    k8s_port_name: str = field(default="http", metadata={"help": "the EndpointSlice port to use"})
    policy: str = field(
        default="least_kv", metadata={"help": "how replicas are picked", "choices": POLICIES}
    )
    session_header: str = field(
        default="x-session-id", metadata={"help": "policy session: the sticky header"}
    )
    prefix_affinity: bool = field(
        default=True,
        metadata={
            "help": "least_kv without prefix affinity (on by default)",
            "negative_flag": True,
        },
    )
    kv_events_port: int = field(
        default=0,
        metadata={
            "help": "subscribe to every replica's KV-cache events at tcp://<replica host>:PORT "
            "and place prompts where their blocks are (0 = off)",
            "metavar": "PORT",
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "with --kv-events-port: the replicas' tokenizer (a tokenizer.json or a "
            "model directory; char[:VOCAB] for simulated replicas without one; default: the "
            "default model's, from the iterserve cache)",
            "metavar": "PATH",
        },
    )
    poll_interval_ms: float = field(default=50.0, metadata={"help": "load polls per replica"})
    poll_timeout_ms: float = field(default=400.0, metadata={"help": "(below --stale-after-ms)"})
    stale_after_ms: float = field(
        default=500.0, metadata={"help": "older reports score as saturated"}
    )
    eject_after: int = field(default=3, metadata={"help": "consecutive failures that eject"})
    connect_timeout_s: float = field(default=2.0, metadata={"help": "to a replica"})
    first_byte_timeout_s: float = field(
        default=300.0,
        metadata={"help": "until a replica's response headers (non-streamed answers come whole)"},
    )
    read_timeout_s: float = field(default=600.0, metadata={"help": "between stream chunks"})
    max_request_body_bytes: int = field(default=4 << 20, metadata={"help": "larger bodies get 413"})
    shutdown_grace_period_s: float = field(
        default=30.0,
        metadata={"help": "after SIGTERM: /ready 503, open requests served for up to this long"},
    )
    host: str = field(default="0.0.0.0", metadata={"help": "address to listen on"})
    port: int = field(default=8080, metadata={"help": "TCP port"})
    api_key: str | None = field(
        default=None, metadata={"help": "Bearer key clients must send (env ITERSERVE_API_KEY)"}
    )
    backend_api_key: str | None = field(
        default=None,
        metadata={
            "help": "the key the replicas expect; clients' own keys are not forwarded "
            "(env ITERSERVE_BACKEND_API_KEY)"
        },
    )
    api_keys_file: str | None = field(
        default=None,
        metadata={
            "help": "YAML list of {key, tenant, tiers, default_tier}: clients send one of its "
            "keys; the router sets their tenant and refuses tiers their key may not use; "
            "re-read on change (instead of --api-key)",
            "metavar": "PATH",
        },
    )
    router_token_file: str | None = field(
        default=None,
        metadata={
            "help": "file holding the router's token, sent to the replicas as their key and "
            "trusted by them for the tenant and tier headers; re-read on change (instead of "
            "--backend-api-key)",
            "metavar": "PATH",
        },
    )

    mode: Mode = field(
        default="proxy",
        metadata={
            "help": "proxy: the router forwards /v1 requests itself; endpoint-picker: it answers "
            "a gateway's Envoy ext_proc calls on --grpc-port with the replica to use "
            "(docs/gateway.md), --port serving /health, /ready and /metrics only"
        },
    )
    grpc_port: int = field(
        default=9002,
        metadata={"help": "endpoint-picker: the ext_proc gRPC port (0: any free port)"},
    )
    destination_endpoints: int = field(
        default=1,
        metadata={
            "help": "endpoint-picker: endpoints in x-gateway-destination-endpoint, the pick "
            "then fallbacks by score (1 for an ORIGINAL_DST cluster, which reads one)"
        },
    )
    shed_queue_depth: int = field(
        default=5,
        metadata={
            "help": "endpoint-picker: a replica with this many requests waiting (or sent and "
            "not yet reported) is saturated"
        },
    )
    shed_kv_usage: float = field(
        default=0.8,
        metadata={"help": "endpoint-picker: a replica with this KV cache usage is saturated"},
    )
    sheddable_tiers: str = field(
        default="best-effort",
        metadata={
            "help": "endpoint-picker: comma-separated tiers answered 429 when every candidate "
            "replica is saturated"
        },
    )
    hold_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "with no ready replica (scale from zero), a new request waits up to this "
            "long for one, then gets 503 (0: 503 at once)"
        },
    )
    max_held_requests: int = field(
        default=256,
        metadata={"help": "requests waiting for a ready replica at once; more get 503 at once"},
    )

    def __post_init__(self) -> None:
        if not self.backend and not self.k8s_service:
            raise ValueError("give --backend URL (repeatable) or --k8s-service NAME")
        if self.backend and self.k8s_service:
            raise ValueError("give either --backend or --k8s-service, not both")
        for name in _POSITIVE:
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{_flag(name)} must be a positive number, got {value}")
        if self.poll_timeout_ms >= self.stale_after_ms:
            raise ValueError("--poll-timeout-ms must be below --stale-after-ms")
        for url in self.backend:
            _check_url(url)
        if not 0 <= self.kv_events_port <= 65535:
            raise ValueError(f"--kv-events-port must be in [0, 65535], got {self.kv_events_port}")
        if self.tokenizer is not None and not self.kv_events_port:
            raise ValueError("--tokenizer is for --kv-events-port (the KV-event match)")
        self._check_picker()
        if self.eject_after < 1:
            raise ValueError("--eject-after must be >= 1")
        if self.api_key and self.api_keys_file:
            raise ValueError("give --api-key (one key) or --api-keys-file, not both")
        if self.backend_api_key and self.router_token_file:
            raise ValueError("give --backend-api-key or --router-token-file, not both")
        if self.api_keys_file and not self.router_token_file:
            # Without the token the replicas trust none of the key's headers: an integer
            # priority escapes its tiers, its default tier is not applied, and a replica
            # with credentials of its own counts every request as the ``default`` tenant.
            raise ValueError(
                "--api-keys-file needs --router-token-file (the replicas trust the key's "
                "tenant and tiers only from requests bearing the router token)"
            )

    def _check_picker(self) -> None:
        """The endpoint-picker and hold flags."""
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"--grpc-port must be a TCP port (0-65535), got {self.grpc_port}")
        if self.destination_endpoints < 1:
            raise ValueError("--destination-endpoints must be >= 1")
        if self.shed_queue_depth < 1:
            raise ValueError("--shed-queue-depth must be >= 1")
        if not 0 < self.shed_kv_usage <= 1:
            raise ValueError(f"--shed-kv-usage must be in (0, 1], got {self.shed_kv_usage}")
        if not 0 <= self.hold_timeout_s < math.inf:
            raise ValueError(f"--hold-timeout-s must be >= 0, got {self.hold_timeout_s}")
        if self.max_held_requests < 0:
            raise ValueError("--max-held-requests must be >= 0")

    @property
    def sheddable(self) -> frozenset[str]:
        """The tier names of ``--sheddable-tiers``."""
        return frozenset(t.strip() for t in self.sheddable_tiers.split(",") if t.strip())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        """The settings from parsed flags; an unset ``--api-key`` / ``--backend-api-key``
        falls back to ``ITERSERVE_API_KEY`` / ``ITERSERVE_BACKEND_API_KEY`` unless
        ``--api-keys-file`` / ``--router-token-file`` takes its place.

        Raises:
            ValueError: as the constructor.
        """
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        values["backend"] = tuple(values["backend"])
        if not values["api_keys_file"]:
            values["api_key"] = values["api_key"] or envs.ITERSERVE_API_KEY
        if not values["router_token_file"]:
            values["backend_api_key"] = values["backend_api_key"] or envs.ITERSERVE_BACKEND_API_KEY
        return cls(**values)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_url(url: str) -> None:
    parsed = urllib.parse.urlparse(url)
    try:
        port = parsed.port
    except ValueError as e:
        raise ValueError(f"--backend {url!r}: {e}") from e
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == 0:
        raise ValueError(f"--backend must look like http://host:port, got {url!r}")
