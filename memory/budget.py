"""A session's KV budget: how much of the cache its conversation may hold, and when to compact.

A budget is given in bytes (``24MiB``) or tokens (``4096tok``). Bytes are what memory costs;
they become tokens through the engine's exact bytes per token for the loaded model and KV
dtypes, so the same ``24MiB`` holds about twice the history with an int8 cache as with bf16.
A remote backend has no known bytes per token, so its budget must be in tokens.

Watermarks: before a request the projected KV (prompt + the reply's reserve) is compared with
``high`` × budget; past it, old turns are compacted until the prompt is under ``low`` × budget.
The gap between the two is what keeps compaction rare, and the prompt's front (and so the prefix
cache) stable between compactions.
"""

import re
from dataclasses import dataclass

from memory.errors import BudgetError
from runtime.sizes import format_bytes, parse_size

_TOKENS_RE = re.compile(r"^\s*([0-9]+)\s*(tok|toks|tokens?)\s*$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class BudgetSpec:
    """A budget as the user wrote it: exactly one of ``num_bytes`` and ``num_tokens`` is set."""

    text: str
    num_bytes: int | None = None
    num_tokens: int | None = None

    @classmethod
    def parse(cls, text: str | int) -> "BudgetSpec":
        if isinstance(text, int):
            return cls(f"{text}tok", num_tokens=text)
        match = _TOKENS_RE.match(text)
        if match:
            return cls(text.strip(), num_tokens=int(match.group(1)))
        try:
            return cls(text.strip(), num_bytes=parse_size(text))
        except ValueError:
            raise BudgetError(
                f"not a KV budget: {text!r} (expected a size such as 24MiB or tokens such as 4096tok)"
            ) from None

    def to_tokens(self, bytes_per_token: int | None) -> int:
        if self.num_tokens is not None:
            return self.num_tokens
        assert self.num_bytes is not None
        if not bytes_per_token:
            raise BudgetError(
                f"a budget in bytes ({self.text}) needs the KV bytes per token, which this backend "
                "cannot report; give it in tokens, e.g. 4096tok"
            )
        return self.num_bytes // bytes_per_token


@dataclass(slots=True)
class Budget:
    """A session's budget in tokens, with its watermarks, the reply reserve and section shares."""

    spec: BudgetSpec
    tokens: int
    bytes_per_token: int | None
    high_watermark: float = 0.85
    low_watermark: float = 0.55
    reserve_tokens: int = 256  # room kept for the reply; the reply's max_tokens is clamped to it
    recall_share: float = 0.15  # most of the budget recalled text may take in one turn
    summary_share: float = 0.15  # a summary larger than this is itself summarized again
    requested_tokens: int | None = None  # what the spec asked for, when the context capped it

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise BudgetError(f"the KV budget {self.spec.text} holds no tokens")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise BudgetError(
                f"watermarks must satisfy 0 < low < high <= 1, got low {self.low_watermark} "
                f"and high {self.high_watermark}"
            )
        if self.reserve_tokens < 1:
            raise BudgetError(f"the reply reserve must be at least 1 token, got {self.reserve_tokens}")
        for name in ("recall_share", "summary_share"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise BudgetError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    @classmethod
    def from_spec(
        cls,
        spec: str | int | BudgetSpec,
        bytes_per_token: int | None,
        max_context_tokens: int | None = None,
        **options: float,
    ) -> "Budget":
        """The budget ``spec`` describes, capped at ``max_context_tokens``: a conversation cannot hold
        more than the model's context (or the KV pool), whatever bytes were granted to it."""
        parsed = spec if isinstance(spec, BudgetSpec) else BudgetSpec.parse(spec)
        tokens = parsed.to_tokens(bytes_per_token)
        if max_context_tokens is not None and tokens > max_context_tokens:
            return cls(parsed, max_context_tokens, bytes_per_token, requested_tokens=tokens, **options)  # type: ignore[arg-type]
        return cls(parsed, tokens, bytes_per_token, **options)  # type: ignore[arg-type]

    @property
    def high_tokens(self) -> int:
        return int(self.tokens * self.high_watermark)

    @property
    def low_tokens(self) -> int:
        return int(self.tokens * self.low_watermark)

    @property
    def num_bytes(self) -> int | None:
        return None if self.bytes_per_token is None else self.tokens * self.bytes_per_token

    def respec(
        self, spec: str | int | BudgetSpec, bytes_per_token: int | None, max_context_tokens: int | None
    ) -> "Budget":
        """The budget ``spec`` describes, with this one's watermarks, reserve and shares."""
        return Budget.from_spec(
            spec,
            bytes_per_token,
            max_context_tokens,
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
            reserve_tokens=self.reserve_tokens,
            recall_share=self.recall_share,
            summary_share=self.summary_share,
        )

    def check_fits(self, fixed_tokens: int) -> None:
        """Refuse a budget that cannot hold ``fixed_tokens`` (the system prompt and the generation
        prompt, which no compaction removes) plus the reply reserve."""
        need = fixed_tokens + self.reserve_tokens
        if need > self.tokens:
            raise BudgetError(
                f"the KV budget {self.spec.text} ({self.tokens:,} tokens) is smaller than the system "
                f"prompt ({fixed_tokens:,} tokens) plus the reply reserve ({self.reserve_tokens:,}); "
                f"raise it to at least {need:,}tok"
            )

    def check_prompt_fits(self, num_tokens: int) -> None:
        """Refuse a prompt of ``num_tokens`` that leaves no room for one generated token; raised
        only for what no compaction can shrink (the turn being answered and the pinned turns)."""
        if num_tokens >= self.tokens:
            raise BudgetError(
                f"the prompt needs {num_tokens:,} tokens but the KV budget holds {self.tokens:,} "
                f"({self.spec.text}); the current turn and the pinned turns alone do not fit — "
                "raise the budget or unpin turns"
            )

    def describe(self) -> str:
        text = f"{self.tokens:,} tokens"
        if self.bytes_per_token is not None:
            text += f" ({format_bytes(self.tokens * self.bytes_per_token)})"
        if self.requested_tokens is not None:
            asked = f"{self.spec.text} would be {self.requested_tokens:,}"
            text += f", the most one conversation can hold; {asked}"
        return text
