"""The runtime's exceptions.

Every message is one line a user can act on; the CLI, the TUI and the headless JSON writer
print ``str(error)`` and nothing else. Invariant violations inside the engine are plain
``AssertionError``/``RuntimeError`` and are bugs, not user errors.
"""


class EngineError(Exception):
    """Base class of every error the runtime reports to a user."""


class ModelError(EngineError):
    """The model could not be found, resolved or loaded."""


class PullError(EngineError):
    """Fetching or converting a model failed (registry unreachable, bad checksum, ...)."""


class PromptTooLongError(EngineError):
    """A prompt exceeds the model's context or the whole KV pool."""


class PoolTooSmallError(EngineError):
    """The KV pool cannot hold even one block."""


class DraftModelError(EngineError):
    """The draft model for speculative decoding cannot serve the model (another vocabulary)."""
