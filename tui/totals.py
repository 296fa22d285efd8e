"""What this session's requests added up to, for ``/stats``: tokens, compute time, cost.

Fed from the agent's ``RequestFinished`` events while the app runs and, for a resumed session,
from the requests the store recorded before it; both spell the same counts differently, so each
has its own constructor-side adapter here.
"""

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class SessionTotals:
    num_requests: int = 0
    num_summary_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    compute_s: float = 0.0
    usd: float | None = None

    def add(
        self,
        kind: str,
        prompt: int,
        cached: int,
        prefilled: int,
        generated: int,
        compute_s: float,
        usd: float | None,
    ) -> None:
        self.num_requests += 1
        self.num_summary_requests += kind == "summary"
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.prefilled_tokens += prefilled
        self.generated_tokens += generated
        self.compute_s += compute_s
        if usd is not None:
            self.usd = (self.usd or 0.0) + usd

    def add_event(self, kind: str, metrics: dict[str, Any], cost: dict[str, Any]) -> None:
        """A ``RequestFinished`` event's metrics (``RequestMetrics.to_dict()``) and cost."""
        self.add(
            kind,
            int(metrics.get("num_prompt_tokens", 0)),
            int(metrics.get("num_cached_tokens", 0)),
            int(metrics.get("num_prefilled_tokens", 0)),
            int(metrics.get("num_generated_tokens", 0)),
            float(cost.get("compute_s") or 0.0),
            cost.get("usd"),
        )

    def add_row(self, row: dict[str, Any]) -> None:
        """A row of the store's ``requests`` table."""
        self.add(
            str(row.get("kind") or "turn"),
            int(row.get("prompt_tokens") or 0),
            int(row.get("cached_tokens") or 0),
            int(row.get("prefilled_tokens") or 0),
            int(row.get("generated_tokens") or 0),
            float(row.get("compute_s") or 0.0),
            row.get("cost_usd"),
        )
