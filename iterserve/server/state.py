"""What the request handlers of one server share (built once the engine has started)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iterserve.config import DEFAULT_MODEL_NAME, EngineConfig, ServerConfig
from iterserve.engine.messages import EngineClient
from iterserve.server.admission import Admission
from iterserve.server.live_config import VersionedSettings
from iterserve.server.metrics import ServerMetrics
from iterserve.server.telemetry import ServerTelemetry


def served_model_name(config: EngineConfig) -> str:
    """The model id of the API: ``--served-model-name``, else the model's name."""
    if config.model.served_model_name:
        return config.model.served_model_name
    if config.model.model == "default":
        return DEFAULT_MODEL_NAME
    path = Path(config.model.model)
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass
class ServerState:
    """The engine client, the tokenizer, the live settings, admission and metrics.

    Attributes:
        engine: the started engine client.
        tokenizer: a Hugging Face tokenizer of the model (chat template, token texts).
        max_model_len: tokens per sequence.
        swap_space: GiB of host swap the engine started with (live ``swap`` needs some).
        settings: the live scheduler settings in force and their version.
        clock: seconds, monotonic: arrival times, latencies, admission (injectable for tests).
        num_active: generation requests whose response has not ended (the drain waits).
        telemetry: the ``sequences`` / ``scheduler_config`` rows (``--telemetry-db``), or None.
    """

    engine: EngineClient
    tokenizer: Any
    model_name: str
    max_model_len: int
    swap_space: float
    server_config: ServerConfig
    settings: VersionedSettings
    metrics: ServerMetrics
    clock: Callable[[], float] = time.monotonic
    admission: Admission = field(default_factory=Admission)
    settings_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    num_active: int = 0
    telemetry: ServerTelemetry | None = None
