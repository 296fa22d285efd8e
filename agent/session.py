"""The agent loop: one conversation's turns, from the user's message to the stored reply.

A turn: the message goes to the context manager, which builds a prompt inside the KV budget
(compacting and recalling as needed); the backend streams the reply; tool calls in the reply are
run (with permission) and their results fed back, up to ``max_tool_rounds`` times; the reply goes
back to memory. Every step is published as an event (``agent/events.py``) and every request is
written to the store with its metrics and cost; what the turn produced comes back as a
``TurnResult`` (``agent/turn_result.py``, re-exported here).

Interrupting a turn (Ctrl-C in a headless run, the cancel key in the TUI) stops generation, stores
the partial reply marked ``interrupted``, and leaves everything stored before it untouched.
"""

import threading
from collections.abc import Callable
from typing import Any

from agent.config import AgentConfig
from agent.cost import Cost, PriceTable, load_price_table, request_cost
from agent.events import (
    Compacted,
    Event,
    RequestFinished,
    TokenDelta,
    ToolCalled,
    ToolFinished,
    TurnFinished,
    TurnStarted,
)
from agent.tools.availability import ToolsDecision, decide_tools
from agent.tools.calls import ToolCallStreamFilter, parse_tool_calls, tool_result_message, tools_system_prompt
from agent.tools.registry import ToolPermissions, ToolRegistry
from agent.turn_result import TurnInterrupted, TurnResult, cost_of, timings_of, usage_of
from memory.compaction import CompactionEvent
from memory.context_manager import ContextManager
from memory.store import Store
from runtime.backends.backend import Backend
from runtime.engine.metrics import RequestMetrics
from runtime.engine.sampling import SamplingParams

EventSink = Callable[[Event], None]


class AgentSession:
    """A conversation driven through a backend, remembered by a context manager."""

    def __init__(
        self, backend: Backend, store: Store, config: AgentConfig, session_id: str | None = None
    ) -> None:
        """A new session, or the stored one with ``session_id`` resumed."""
        self.backend = backend
        self.config = config
        self.prices = build_prices(config, backend.model_name)
        self.tools: ToolRegistry | None = None
        self.tools_decision: ToolsDecision = decide_tools(
            str(config.tools), backend.kind, backend.model_name, backend.tokenizer
        )
        if self.tools_decision.enabled:
            permissions = ToolPermissions.parse(
                config.allow_tools, root=config.workdir, extra_paths=config.extra_paths
            )
            self.tools = ToolRegistry(permissions, recall=self._recall_tool)
        self._sink: EventSink | None = None
        self._turn: TurnResult | None = None  # the turn whose requests are being recorded
        self._current_turn = 0
        self.context = self._open_context(store, session_id)

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(
        cls, backend: Backend, store: Store, config: AgentConfig, session_id: str | None = None
    ) -> "AgentSession":
        """A new session, or the stored one with ``session_id`` resumed."""
        return cls(backend, store, config, session_id)

    def _open_context(self, store: Store, session_id: str | None) -> ContextManager:
        """The session's context manager, reporting its compactions and summary requests here."""
        config = self.config
        options: dict[str, Any] = {
            "recall": config.recall,
            "max_summary_tokens": config.summary_tokens,
            "on_event": self._on_compaction,
            "on_request": self._on_summary_request,
        }
        if session_id is not None:
            return ContextManager.resume(store, self.backend, session_id, config.kv_budget, **options)
        system = config.system if config.system is not None else DEFAULT_SYSTEM
        if self.tools is not None:
            system = f"{system}\n\n{tools_system_prompt(self.tools.specs())}"
        return ContextManager.create(
            store,
            self.backend,
            system=system,
            budget=config.kv_budget or default_budget(self.backend),
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
            reserve_tokens=config.reply_reserve,
            **options,
        )

    @property
    def session_id(self) -> str:
        return self.context.session_id

    @property
    def store(self) -> Store:
        return self.context.store

    # -- a turn -------------------------------------------------------------------------------

    def run_turn(
        self, text: str, on_event: EventSink | None = None, cancel: threading.Event | None = None
    ) -> TurnResult:
        """Answer one user message; raises ``TurnInterrupted`` (after storing) when cancelled."""
        self._sink = on_event
        message = self.context.add_user(text)
        self._current_turn = message.turn
        result = self._turn = TurnResult(self.session_id, message.turn, "", None, False)
        try:
            self._run_rounds(result, cancel)
        finally:
            self._sink = self._turn = None
        return result

    def _run_rounds(self, result: TurnResult, cancel: threading.Event | None) -> None:
        for round_no in range(self.config.max_tool_rounds + 1):
            prompt = self.context.next_prompt()
            result.compactions.extend(prompt.compactions)
            self._emit(
                TurnStarted(
                    self.session_id,
                    result.turn,
                    round_no,
                    prompt.num_tokens,
                    dict(prompt.sections),
                    prompt.budget_tokens,
                    [h.to_dict() for h in prompt.recalled],
                )
            )
            params = SamplingParams(
                max_tokens=max(1, min(self.config.max_tokens, prompt.max_tokens)),
                temperature=self.config.temperature,
                top_k=self.config.top_k,
                top_p=self.config.top_p,
                seed=self.config.seed,
            )
            reply, finish_reason, metrics = self._stream(prompt, params, result.turn, cancel)
            kind = "turn" if round_no == 0 else "tool"
            if metrics is None:  # cut off before the backend reported: count what we saw
                metrics = RequestMetrics(
                    num_prompt_tokens=prompt.num_tokens,
                    num_prefilled_tokens=prompt.num_tokens,
                    num_generated_tokens=len(self.context.renderer.encode(reply)) if reply else 0,
                )
            kv_tokens = prompt.num_tokens + metrics.num_generated_tokens
            self._record(kind, metrics, kv_tokens, finish_reason)
            result.kv = self._kv(kv_tokens)
            interrupted = finish_reason == "abort"
            visible, calls, errors = parse_tool_calls(reply) if self.tools is not None else (reply, [], [])
            self.context.add_assistant(reply, interrupted=interrupted)
            if interrupted:
                self._finish(result, visible, finish_reason, interrupted=True)
                raise TurnInterrupted(result)
            if not (calls or errors) or round_no == self.config.max_tool_rounds:
                self._finish(result, visible, finish_reason, interrupted=False)
                return
            result.num_tool_rounds += 1
            self._run_tools(calls, errors, result.turn)

    def _stream(
        self, prompt: Any, params: SamplingParams, turn: int, cancel: threading.Event | None
    ) -> tuple[str, str | None, RequestMetrics | None]:
        """Stream one reply. On cancel the backend is asked to abort (the local engine then ends
        the stream itself, with the request's metrics); a backend that cannot is simply closed."""
        parts: list[str] = []
        shown = ToolCallStreamFilter()
        finish_reason: str | None = None
        metrics: RequestMetrics | None = None
        cancelling = False
        stream = self.backend.stream(prompt.chat_prompt(), params)
        try:
            for delta in stream:
                if delta.text:
                    parts.append(delta.text)
                    visible = shown.feed(delta.text) if self.tools is not None else delta.text
                    if visible and not cancelling:
                        self._emit(TokenDelta(turn, visible))
                if delta.finished:
                    finish_reason = delta.finish_reason
                    metrics = delta.metrics
                elif cancel is not None and cancel.is_set() and not cancelling:
                    cancelling = True
                    abort = getattr(self.backend, "cancel", None)
                    if abort is None or not abort(delta.request_id):
                        break
        except KeyboardInterrupt:
            finish_reason = "abort"
        finally:
            stream.close()  # aborts the request in the engine / closes the HTTP stream
        if self.tools is not None:
            tail = shown.flush()
            if tail and not cancelling:
                self._emit(TokenDelta(turn, tail))
        if cancelling or finish_reason is None:
            finish_reason = "abort"
        return "".join(parts), finish_reason, metrics

    def _run_tools(self, calls: list[Any], errors: list[str], turn: int) -> None:
        assert self.tools is not None
        for error in errors:
            content = f"<tool_response>\nerror: {error}\n</tool_response>"
            self.context.add_tool(content)
            self._emit(ToolFinished(turn, "(malformed)", False, False, False, error, 0.0))
        for call in calls:
            self._emit(ToolCalled(turn, call.name, dict(call.arguments)))
            outcome = self.tools.run(call)
            self.context.add_tool(tool_result_message(call, outcome)["content"])
            self._emit(
                ToolFinished(
                    turn,
                    call.name,
                    outcome.ok,
                    outcome.refused,
                    outcome.truncated,
                    outcome.content,
                    round(outcome.duration_ms, 3),
                )
            )

    def _finish(self, result: TurnResult, answer: str, finish_reason: str | None, interrupted: bool) -> None:
        result.answer = answer
        result.finish_reason = finish_reason
        result.interrupted = interrupted
        if not result.kv:
            result.kv = self._kv(0)
        self._emit(
            TurnFinished(
                self.session_id,
                result.turn,
                answer,
                finish_reason,
                interrupted,
                result.usage(),
                result.timings(),
                result.kv,
                result.cost(),
                result.num_tool_rounds,
            )
        )

    # -- commands (the TUI's slash commands and script steps) ---------------------------------

    def pin(self, turn: int) -> None:
        self.context.pin(turn)

    def unpin(self, turn: int) -> None:
        self.context.unpin(turn)

    def set_budget(self, spec: str) -> None:
        self.context.set_budget(spec)

    def compact(self, focus: str | None = None, on_event: EventSink | None = None) -> CompactionEvent | None:
        self._sink = on_event
        try:
            return self.context.compact(focus)
        finally:
            self._sink = None

    def clear(self, on_event: EventSink | None = None) -> CompactionEvent | None:
        self._sink = on_event
        try:
            return self.context.clear()
        finally:
            self._sink = None

    # -- accounting ---------------------------------------------------------------------------

    def _kv(self, kv_tokens: int) -> dict[str, Any]:
        budget = self.context.budget
        k_dtype, v_dtype = self.backend.kv_dtypes
        bytes_per_token = self.backend.bytes_per_token
        return {
            "tokens": kv_tokens,
            "bytes": kv_tokens * bytes_per_token if bytes_per_token else None,
            "context_tokens": self.context.context_tokens(),
            "budget_tokens": budget.tokens,
            "budget_bytes": budget.num_bytes,
            "bytes_per_token": bytes_per_token,
            "k_dtype": k_dtype,
            "v_dtype": v_dtype,
            "weights": self.backend.weight_format,
            "compiled": self.backend.compiled,
            "speculate": self.backend.speculate,
            "wide_step_rows": self.backend.wide_step_rows,
        }

    def _record(self, kind: str, metrics: RequestMetrics, kv_tokens: int, finish_reason: str | None) -> Cost:
        cost = request_cost(metrics, self.prices)
        k_dtype, v_dtype = self.backend.kv_dtypes
        bytes_per_token = self.backend.bytes_per_token
        self.store.add_request(
            self.session_id,
            {
                "kind": kind,
                "turn": self._current_turn or self.context.current_turn,
                "model": self.backend.model_name,
                "backend": self.backend.kind,
                "k_dtype": k_dtype,
                "v_dtype": v_dtype,
                "weights": self.backend.weight_format,
                "compiled": None if (compiled := self.backend.compiled) is None else int(compiled),
                "prompt_tokens": metrics.num_prompt_tokens,
                "cached_tokens": metrics.num_cached_tokens,
                "disk_cached_tokens": metrics.num_disk_cached_tokens,
                "prefilled_tokens": metrics.num_prefilled_tokens,
                "generated_tokens": metrics.num_generated_tokens,
                "queue_ms": metrics.queue_ms,
                "prefill_ms": metrics.prefill_ms,
                "ttft_ms": metrics.ttft_ms,
                "decode_ms": metrics.decode_ms,
                "prefill_tok_s": metrics.prefill_tok_s,
                "decode_tok_s": metrics.decode_tok_s,
                "num_drafts": metrics.num_drafts,
                "num_draft_tokens": metrics.num_draft_tokens,
                "num_accepted_tokens": metrics.num_accepted_tokens,
                "kv_tokens": kv_tokens,
                "kv_bytes": kv_tokens * bytes_per_token if bytes_per_token else None,
                "budget_tokens": self.context.budget.tokens,
                "compute_s": cost.compute_s,
                "cost_usd": cost.usd,
                "finish_reason": finish_reason,
                "interrupted": int(finish_reason == "abort"),
                "token_source": "engine"
                if self.backend.kind == "local"
                else getattr(self.backend, "last_usage_source", "server"),
            },
        )
        if kind != "summary" and self._turn is not None:
            self._turn.requests.append(metrics)
            self._turn.costs.append(cost)
        self._emit(
            RequestFinished(self._current_turn, kind, metrics.to_dict(), self._kv(kv_tokens), cost.to_dict())
        )
        return cost

    def _on_summary_request(self, kind: str, metrics: RequestMetrics, kv_tokens: int) -> None:
        self._record(kind, metrics, kv_tokens, "stop")

    def _on_compaction(self, event: CompactionEvent) -> None:
        self._emit(Compacted(self._current_turn or self.context.current_turn, event.to_dict()))

    def _recall_tool(self, query: str, limit: int) -> list[dict[str, Any]]:
        return [
            {
                "message_id": h.message_id,
                "turn": h.turn,
                "role": h.role,
                "content": h.content,
                "state": h.state,
            }
            for h in self.context.search(query, limit)
        ]

    def _emit(self, event: Event) -> None:
        if self._sink is not None:
            self._sink(event)


DEFAULT_SYSTEM = "You are a helpful assistant."


def default_budget(backend: Backend) -> str:
    """Without --kv-budget: the model's context, within the engine's pool (8,192 tokens when the
    backend cannot tell)."""
    return f"{backend.max_context_tokens or 8192}tok"


def build_prices(config: AgentConfig, model_name: str) -> PriceTable:
    table = load_price_table(config.price_table) if config.price_table else None
    model = model_name if config.backend == "openai" else None
    return PriceTable.from_args(config.price_per_hour, config.prices, model=model, table=table)


__all__ = [
    "AgentSession",
    "TurnInterrupted",
    "TurnResult",
    "cost_of",
    "default_budget",
    "timings_of",
    "usage_of",
]
