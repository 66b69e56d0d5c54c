"""``iterserve serve`` / ``generate`` engine flags, one per config dataclass field (argparse
and :mod:`iterserve.config` only, so the control plane can build the same parser: the
operator checks a pod's arguments with it)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from iterserve.config import ENGINE_CONFIG_CLASSES, field_type, read_tiers_file


def tiers_from_file(path: str) -> list[dict[str, Any]]:
    """``--tiers FILE``: a YAML list of {name, priority, max_queue_wait_ms, ttft_target_ms}."""
    try:
        return read_tiers_file(Path(path))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_engine_flags(
    parser: argparse.ArgumentParser,
    classes: tuple[type, ...] = ENGINE_CONFIG_CLASSES,
    tiers: Callable[[str], Any] = tiers_from_file,
) -> None:
    """One flag per config field; unset flags stay absent so the dataclass default applies.

    Args:
        tiers: how ``--tiers`` reads its value (default: the file it names).
    """
    for cls in classes:
        group = parser.add_argument_group(cls.__name__)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.default is not None and f.name != "tiers":
                help_text += f" (default: {f.default})"
            tp = field_type(cls, f.name)
            kwargs: dict[str, Any] = {
                "dest": f.name,
                "default": argparse.SUPPRESS,
                "help": help_text,
            }
            if f.name == "tiers":
                group.add_argument(flag, type=tiers, **kwargs)
            elif tp is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            elif typing.get_origin(tp) is typing.Literal:
                group.add_argument(flag, choices=typing.get_args(tp), **kwargs)
            else:
                group.add_argument(flag, type=tp, **kwargs)
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML file setting any engine flag (keys like max_num_seqs or max-num-seqs, as "
        "vLLM's --config); flags given on the command line win",
    )
