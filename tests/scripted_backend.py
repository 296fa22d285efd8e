"""A model stand-in for agent tests: it replays canned replies through the real Backend shape."""

import threading
from collections.abc import Generator
from typing import Any

from runtime.backends.backend import ChatPrompt
from runtime.engine.engine import CompletionDelta
from runtime.engine.metrics import RequestMetrics
from runtime.engine.sampling import SamplingParams


class ScriptedBackend:
    """Replies with the next canned text, a few characters per delta."""

    kind = "local"
    model_name = "scripted"

    def __init__(
        self,
        tokenizer: Any,
        replies: list[str],
        gate: threading.Event | None = None,
        drafts: tuple[int, int, int] | None = None,
        weights: str = "float32",
        compiled: bool = False,
    ) -> None:
        """``drafts``: every request's (num_drafts, num_draft_tokens, num_accepted_tokens), as an
        engine speculating with ngram counts them; None: an engine that does not speculate.
        ``weights`` / ``compiled``: the weight format and compiled step the backend reports."""
        self._tokenizer = tokenizer
        self.replies = list(replies)
        self.prompts: list[ChatPrompt] = []
        self.gate = gate
        self.drafts = drafts
        self.weights = weights
        self.compiled_step = compiled

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def bytes_per_token(self) -> int:
        return 100

    @property
    def kv_dtypes(self) -> tuple[str, str]:
        return "float32", "float32"

    @property
    def weight_format(self) -> str:
        return self.weights

    @property
    def compiled(self) -> bool:
        return self.compiled_step

    @property
    def speculate(self) -> str:
        return "off" if self.drafts is None else "ngram"

    @property
    def wide_step_rows(self) -> None:
        return None

    @property
    def max_context_tokens(self) -> int:
        return 8192

    def stats(self) -> None:
        return None

    def stream(self, prompt: ChatPrompt, params: SamplingParams) -> Generator[CompletionDelta, None, None]:
        self.prompts.append(prompt)
        text = self.replies.pop(0)
        pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
        for i, piece in enumerate(pieces):
            if self.gate is not None and i == 2:
                self.gate.wait(5)
            yield CompletionDelta("r", [0], piece)
        assert prompt.token_ids is not None
        num_drafts, num_draft_tokens, num_accepted_tokens = self.drafts or (0, 0, 0)
        metrics = RequestMetrics(
            num_prompt_tokens=len(prompt.token_ids),
            num_prefilled_tokens=len(prompt.token_ids),
            prefill_ms=10.0,
            ttft_ms=12.0,
            num_generated_tokens=len(pieces),
            decode_ms=20.0,
            num_drafts=num_drafts,
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
        )
        yield CompletionDelta("r", [], "", finished=True, finish_reason="stop", metrics=metrics)
