"""iterserve: continuous-batching LLM serving.

``LLM`` and ``SamplingParams`` are loaded lazily so that ``import iterserve.router`` or
``iterserve.operator`` never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from iterserve.engine.sampling_params import SamplingParams
    from iterserve.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from iterserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from iterserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'iterserve' has no attribute {name!r}")
