"""liubai's inference engine: paged, prefix-cached KV memory under continuous batching.

Importing this package is cheap (no torch, no transformers): the names below load on first
use, so ``liubai --help`` and error paths stay fast. The model loads when an :class:`Engine`
is created.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from runtime.errors import EngineError, ModelError, PoolTooSmallError, PromptTooLongError, PullError

if TYPE_CHECKING:
    from runtime.engine.engine import Completion, CompletionDelta, Engine
    from runtime.engine.metrics import EngineStats, RequestMetrics
    from runtime.engine.sampling import SamplingParams

_LAZY = {
    "Completion": "runtime.engine.engine",
    "CompletionDelta": "runtime.engine.engine",
    "Engine": "runtime.engine.engine",
    "EngineStats": "runtime.engine.metrics",
    "RequestMetrics": "runtime.engine.metrics",
    "SamplingParams": "runtime.engine.sampling",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    return getattr(import_module(module), name)


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
