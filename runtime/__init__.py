"""liubai's inference engine: paged, prefix-cached KV memory under continuous batching.

Importing this package is cheap (no torch, no transformers): the names below load on first
use, so ``liubai --help`` and error paths stay fast. The model loads when an :class:`Engine`
is created.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .errors import EngineError, ModelError, PoolTooSmallError, PromptTooLongError, PullError

if TYPE_CHECKING:
    from .engine import Completion, CompletionDelta, Engine
    from .metrics import EngineStats, RequestMetrics
    from .sampling import SamplingParams

_LAZY = {
    "Completion": ".engine",
    "CompletionDelta": ".engine",
    "Engine": ".engine",
    "EngineStats": ".metrics",
    "RequestMetrics": ".metrics",
    "SamplingParams": ".sampling",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)


__all__ = [
    "Completion",
    "CompletionDelta",
    "Engine",
    "EngineError",
    "EngineStats",
    "ModelError",
    "PoolTooSmallError",
    "PromptTooLongError",
    "PullError",
    "RequestMetrics",
    "SamplingParams",
]
