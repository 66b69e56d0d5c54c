"""The live scheduler settings of a server: a view, a versioned merge, a hash.

``GET/PUT /admin/scheduler_config`` (docs/server.md, "Live scheduler settings"): a PUT carries any
subset of :data:`~iterserve.config.LIVE_SCHEDULER_KEYS` and optionally ``config_version``; it is
merged with the current settings and validated as a whole by the same dataclasses that check the
command line, so a live change can never produce a configuration the CLI would refuse.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from iterserve.config import (
    ENGINE_CONFIG_CLASSES,
    LIVE_SCHEDULER_KEYS,
    ConfigError,
    SchedulerConfig,
    ServerConfig,
    check_rules,
    field_values,
    parse_tiers,
)

_RESTART_ONLY = {
    f.name for cls in (*ENGINE_CONFIG_CLASSES, ServerConfig) for f in dataclasses.fields(cls)
} - set(LIVE_SCHEDULER_KEYS)


_FLOAT_KEYS = {"kv_watermark", "aging_interval_s"}


class LiveConfigError(ValueError):
    """A PUT that cannot be applied (answered 422 with this message)."""


def settings_view(config: SchedulerConfig) -> dict[str, Any]:
    """The live settings as JSON-ready values (tiers as a list of mappings)."""
    view: dict[str, Any] = {}
    for key in LIVE_SCHEDULER_KEYS:
        value = getattr(config, key)
        if key == "tiers":
            value = [dataclasses.asdict(t) for t in value]
        elif isinstance(value, int | float) and not isinstance(value, bool):
            # Canonical types, so that 2 and 2.0 hash (and show) alike.
            value = float(value) if key in _FLOAT_KEYS else int(value)
        view[key] = value
    return view


def settings_hash(config: SchedulerConfig) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of :func:`settings_view`."""
    canonical = json.dumps(settings_view(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class VersionedSettings:
    """What the server runs with: the scheduler settings and their version."""

    config: SchedulerConfig
    version: int

    def view(self) -> dict[str, Any]:
        return {
            **settings_view(self.config),
            "config_version": self.version,
            "config_hash": settings_hash(self.config),
        }


def merge(
    current: VersionedSettings,
    changes: Any,
    swap_space: float,
    max_model_len: int,
) -> VersionedSettings | None:
    """Merge a PUT body into the current settings; None when it changes nothing.

    Args:
        current: the settings in force.
        changes: the decoded JSON body (must be an object).
        swap_space: GiB of host swap the server started with (``swap`` needs some).
        max_model_len: tokens (0: not known); without chunked prefill the budget must
            cover it.

    Raises:
        LiveConfigError: not an object, unknown or restart-only keys, invalid values or
            combinations, a bad ``config_version``.
    """
    if not isinstance(changes, dict):
        raise LiveConfigError("the body must be a JSON object of settings")
    changes = dict(changes)
    version = changes.pop("config_version", None)
    if version is not None and (
        isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**53
    ):
        raise LiveConfigError(
            f"config_version must be an integer in [0, 2**53) (exact in JSON), got {version!r}"
        )
    changes.pop("config_hash", None)  # echoing a GET back is allowed; the hash is derived
    restart_only = sorted(k for k in changes if k in _RESTART_ONLY)
    if restart_only:
        raise LiveConfigError(
            f"{restart_only} cannot change while the server runs (restart it with new flags); "
            f"live settings: {list(LIVE_SCHEDULER_KEYS)}"
        )
    unknown = sorted(k for k in changes if k not in LIVE_SCHEDULER_KEYS)
    if unknown:
        raise LiveConfigError(
            f"unknown settings {unknown}; live settings: {list(LIVE_SCHEDULER_KEYS)}"
        )
    changes = {k: _as_current_type(v, getattr(current.config, k)) for k, v in changes.items()}
    try:
        if "tiers" in changes:
            if not isinstance(changes["tiers"], list):
                raise ConfigError("tiers must be a list of {name, priority, ...} objects")
            changes["tiers"] = parse_tiers(changes["tiers"])
        config = dataclasses.replace(current.config, **changes)
    except (ConfigError, TypeError) as e:
        raise LiveConfigError(str(e)) from e
    try:  # the rules across the scheduler's settings and the server's start-up ones
        check_rules(
            {**field_values(config), "swap_space": swap_space, "max_model_len": max_model_len}
        )
    except ConfigError as e:
        raise LiveConfigError(str(e)) from e
    same_values = settings_hash(config) == settings_hash(current.config)
    # Same values under no newer version: nothing to do (an operator re-sending an older
    # generation must not bump the version forever).
    if same_values and (version is None or version <= current.version):
        return None
    new_version = version if version is not None and version > current.version else None
    return VersionedSettings(config, new_version or current.version + 1)


def _as_current_type(value: Any, current: Any) -> Any:
    """A JSON number with no fractional part (``2.0``) as an int where the setting is one (JSON
    Schema's ``integer`` includes it, as the request API takes it); anything else as it came."""
    is_int = isinstance(current, int) and not isinstance(current, bool)
    if is_int and isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value
