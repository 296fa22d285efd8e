"""What one user turn produced: its answer, its requests' metrics and costs, its compactions.

A turn makes one request, plus one per tool round, plus any summarization requests compaction
needs; ``TurnResult`` sums the first two kinds (summaries are logged, not billed to the turn).
The sums are functions of a list of requests, so the headless runner adds up whole scripts with
the same code: ``usage_of``, ``timings_of`` and ``cost_of`` give ``--json``'s ``usage``,
``timings`` and ``cost``.
"""

from dataclasses import dataclass, field
from typing import Any

from agent.cost import Cost
from memory.compaction import CompactionEvent
from runtime.engine.metrics import RequestMetrics


class TurnInterrupted(Exception):
    """A turn was cancelled; its partial reply is stored, marked interrupted."""

    def __init__(self, result: "TurnResult") -> None:
        super().__init__("the reply was interrupted")
        self.result = result


@dataclass(slots=True)
class TurnResult:
    """What one user turn produced, summed over its requests (tool rounds included)."""

    session_id: str
    turn: int
    answer: str
    finish_reason: str | None
    interrupted: bool
    requests: list[RequestMetrics] = field(default_factory=list)
    costs: list[Cost] = field(default_factory=list)
    compactions: list[CompactionEvent] = field(default_factory=list)
    kv: dict[str, Any] = field(default_factory=dict)
    num_tool_rounds: int = 0

    def usage(self) -> dict[str, int]:
        return usage_of(self.requests)

    def timings(self) -> dict[str, float]:
        return timings_of(self.requests, self.requests[0].ttft_ms if self.requests else 0.0)

    def cost(self) -> dict[str, Any]:
        return cost_of(self.costs)


def usage_of(requests: list[RequestMetrics]) -> dict[str, int]:
    """Token counts summed over requests: what ``--json``'s ``usage`` reports."""
    return {
        "prompt_tokens": sum(m.num_prompt_tokens for m in requests),
        "cached_tokens": sum(m.num_cached_tokens for m in requests),
        "disk_cached_tokens": sum(m.num_disk_cached_tokens for m in requests),
        "prefilled_tokens": sum(m.num_prefilled_tokens for m in requests),
        "generated_tokens": sum(m.num_generated_tokens for m in requests),
    }


def timings_of(requests: list[RequestMetrics], ttft_ms: float) -> dict[str, float]:
    """Prefill and decode time summed over requests, and the decode rate they give together;
    speculative decoding's counters summed, and the acceptance they give together (0 without
    verification steps)."""
    decode_ms = sum(m.decode_ms for m in requests)
    decoded = sum(max(0, m.num_generated_tokens - 1) for m in requests)
    spec = RequestMetrics(
        num_drafts=sum(m.num_drafts for m in requests),
        num_draft_tokens=sum(m.num_draft_tokens for m in requests),
        num_accepted_tokens=sum(m.num_accepted_tokens for m in requests),
    )
    return {
        "ttft_ms": round(ttft_ms, 3),
        "prefill_ms": round(sum(m.prefill_ms for m in requests), 3),
        "decode_ms": round(decode_ms, 3),
        "decode_tok_s": round(decoded / (decode_ms / 1000), 3) if decode_ms > 0 else 0.0,
        "num_drafts": spec.num_drafts,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
        "acceptance_rate": round(spec.acceptance_rate, 4),
        "mean_accepted_length": round(spec.mean_accepted_length, 3),
    }


def cost_of(costs: list[Cost]) -> dict[str, Any]:
    def total(name: str) -> float | None:
        values = [getattr(c, name) for c in costs if getattr(c, name) is not None]
        return round(sum(values), 9) if values else None

    return {
        "compute_s": round(sum(c.compute_s for c in costs), 6),
        "usd": total("usd"),
        "usd_machine": total("usd_machine"),
        "usd_tokens": total("usd_tokens"),
    }
