"""The one interface ``memory/`` and ``agent/`` use to reach a model: a backend.

Two implementations share it: :class:`LocalBackend` wraps liubai's own :class:`Engine`, and the
OpenAI-compatible HTTP client (``runtime/backends/openai_backend.py``) drives a remote server (vLLM,
SGLang, llama.cpp, or ``liubai serve``). A prompt travels as both chat messages and, where the
tokenizer is local, the exact token ids they render to: the local engine consumes the ids (so the
prefix cache sees exactly what memory counted), a remote server the messages.

What a backend cannot know it reports as ``None``: a remote server's KV bytes per token, for
instance, so a budget over it is kept in tokens.
"""

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from runtime.engine.engine import CompletionDelta, Engine
    from runtime.engine.metrics import EngineStats
    from runtime.engine.sampling import SamplingParams


@dataclass(slots=True)
class ChatPrompt:
    """A prompt as chat messages (``{"role", "content"}``) and, when known, its token ids."""

    messages: list[dict[str, str]]
    token_ids: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    """What the agent loop and the context manager need from a model server."""

    kind: str  # "local" or "openai"
    model_name: str

    @property
    def tokenizer(self) -> Any | None:
        """The model's tokenizer when it is available locally (token counting, chat template)."""

    @property
    def bytes_per_token(self) -> int | None:
        """KV bytes one token costs, or None when the backend cannot know (a remote server)."""

    @property
    def kv_dtypes(self) -> tuple[str | None, str | None]:
        """(K storage, V storage) names, or None where unknown."""

    @property
    def weight_format(self) -> str | None:
        """How the model's weights are stored (float32, bfloat16, int8, int4), or None where unknown."""

    @property
    def compiled(self) -> bool | None:
        """Whether decode steps run through compiled graphs now, or None where unknown."""

    @property
    def speculate(self) -> str | None:
        """How the engine speculates by default ("off", "ngram" or "draft"), or None where unknown."""

    @property
    def wide_step_rows(self) -> int | None:
        """The fewest rows of a step that multiply by bfloat16 copies of quantized weights
        (runtime/layers/wide_steps.py), or None: never, or unknown."""

    @property
    def max_context_tokens(self) -> int | None:
        """The most tokens one conversation's KV can hold (the model's context, within the KV
        pool), or None when the backend cannot know."""

    def stream(
        self, prompt: ChatPrompt, params: "SamplingParams"
    ) -> Generator["CompletionDelta", None, None]:
        """Deltas of one reply; the last has ``finished`` set and carries the request metrics.

        Closing the generator early aborts the request (and frees its KV, or its connection).
        """

    def stats(self) -> "EngineStats | None":
        """A snapshot of the KV pool and prefix cache, or None when the backend has none."""


class LocalBackend:
    """liubai's own engine behind the :class:`Backend` interface."""

    kind = "local"

    def __init__(self, engine: "Engine", model_name: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name or engine.model_path.name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def bytes_per_token(self) -> int:
        return int(self.engine.kv_cache.bytes_per_token)

    @property
    def kv_dtypes(self) -> tuple[str, str]:
        return self.engine.kv_cache.k_dtype, self.engine.kv_cache.v_dtype

    @property
    def weight_format(self) -> str:
        return str(self.engine.weight_format)

    @property
    def compiled(self) -> bool:
        return bool(self.engine.compiled)

    @property
    def speculate(self) -> str:
        return self.engine.speculate

    @property
    def wide_step_rows(self) -> int | None:
        return self.engine.wide_step_rows

    @property
    def max_context_tokens(self) -> int:
        return min(self.engine.max_model_len, self.engine.pool_capacity_tokens)

    def stream(
        self, prompt: ChatPrompt, params: "SamplingParams"
    ) -> Generator["CompletionDelta", None, None]:
        if prompt.token_ids is None:
            raise ValueError("the local engine needs the prompt's token ids")
        return self.engine.stream(prompt.token_ids, params)

    def cancel(self, request_id: str) -> bool:
        """Abort a request mid-stream; its stream then ends with the metrics of what was done."""
        self.engine.abort(request_id)
        return True

    def stats(self) -> "EngineStats":
        return self.engine.stats()
