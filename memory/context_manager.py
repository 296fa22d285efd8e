"""What the model sees of a conversation, kept inside the session's KV budget: the orchestrator.

The context manager holds one session's messages and runs each request's prompt through the
steps that the other modules of ``memory/`` own: the layout of the prompt
(``memory/prompt_layout.py``), which turns leave when the budget runs short
(``memory/eviction.py``), the summary that replaces them (``memory/summarizer.py``), what comes
back by search (``memory/recall.py``), the facts kept verbatim beside the summary
(``memory/fact_ledger.py``), and the store (``memory/store.py``).

Every message is written to the store when it is added, and a compaction is written (summary,
record, new message states) before the live context changes, so nothing is lost whenever the
process stops.
"""

import time
from collections.abc import Callable
from typing import Any

import memory.eviction as eviction
from memory.budget import Budget, BudgetSpec
from memory.chat_render import renderer_for
from memory.compaction import CompactionEvent, elapsed_ms
from memory.errors import StoreError
from memory.fact_ledger import (
    LEDGER_SHARE,
    Fact,
    extract_facts,
    fit_ledger,
    join_summary,
    ledger_of,
    prose_of,
    render_ledger,
    states,
)
from memory.prompt_layout import SECTIONS, BuiltPrompt, layout, render, summary_tokens
from memory.recall import Recall, fts_query, recall_for_new_message
from memory.records import MessageRecord, SearchHit, SessionRecord
from memory.store import Store
from memory.summarizer import RequestObserver, Summarizer, SummaryResult
from memory.turn_map import TurnInfo, turn_map_of
from runtime.backends.backend import Backend
from runtime.engine.metrics import RequestMetrics

DEFAULT_SYSTEM = "You are a helpful assistant."

EventObserver = Callable[[CompactionEvent], None]


class ContextManager:
    """One session's live context: messages in, budgeted prompts out, compactions recorded."""

    def __init__(
        self,
        store: Store,
        backend: Backend,
        session: SessionRecord,
        budget: Budget,
        *,
        recall: bool = True,
        ledger_recall: bool = True,
        max_summary_tokens: int = 192,
        on_event: EventObserver | None = None,
        on_request: RequestObserver | None = None,
    ) -> None:
        self.store = store
        self.backend = backend
        self.session = session
        self.renderer = renderer_for(backend.tokenizer, backend.model_name)
        self.recall_enabled = recall
        self.ledger_recall = ledger_recall  # recall through the fact ledger besides full-text search
        self.on_event = on_event
        self.on_request = on_request
        self.summarizer = Summarizer(backend, self.renderer, max_summary_tokens, self._observe_request)
        self._messages: list[MessageRecord] = store.messages(session.id)
        self._facts: dict[int, list[Fact]] = {}  # message id -> its facts (extraction is pure)
        self._summary_text: str | None = None
        if session.summary_id is not None:
            self._summary_text = store.get_summary(session.summary_id).text
        self.budget = budget
        budget.check_fits(self._section_tokens_fixed())

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        store: Store,
        backend: Backend,
        *,
        system: str | None = None,
        budget: str | int | BudgetSpec,
        high_watermark: float = 0.85,
        low_watermark: float = 0.55,
        reserve_tokens: int = 256,
        **options: Any,
    ) -> "ContextManager":
        """A new session, validated before anything is stored."""
        system = system if system is not None else DEFAULT_SYSTEM
        parsed = Budget.from_spec(
            budget,
            backend.bytes_per_token,
            backend.max_context_tokens,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            reserve_tokens=reserve_tokens,
        )
        renderer = renderer_for(backend.tokenizer, backend.model_name)
        parsed.check_fits(renderer.count("system", system, first=True) + len(renderer.generation_prompt_ids))
        k_dtype, v_dtype = backend.kv_dtypes
        session = store.create_session(
            model=backend.model_name,
            backend=backend.kind,
            system=system,
            budget_spec=parsed.spec.text,
            budget_tokens=parsed.tokens,
            bytes_per_token=backend.bytes_per_token,
            k_dtype=k_dtype,
            v_dtype=v_dtype,
            high_watermark=parsed.high_watermark,
            low_watermark=parsed.low_watermark,
            reserve_tokens=parsed.reserve_tokens,
            token_source=renderer.source,
        )
        return cls(store, backend, session, parsed, **options)

    @classmethod
    def resume(
        cls, store: Store, backend: Backend, session_id: str, budget: str | None = None, **options: Any
    ) -> "ContextManager":
        """A stored session, its budget re-derived for this backend's bytes per token."""
        session = store.get_session(session_id)
        parsed = Budget.from_spec(
            budget or session.budget_spec,
            backend.bytes_per_token,
            backend.max_context_tokens,
            high_watermark=session.high_watermark,
            low_watermark=session.low_watermark,
            reserve_tokens=session.reserve_tokens,
        )
        manager = cls(store, backend, session, parsed, **options)
        if budget is not None or parsed.tokens != session.budget_tokens:
            manager._save_budget(parsed)
        return manager

    # -- state --------------------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self.session.id

    @property
    def summary(self) -> str | None:
        return self._summary_text

    @property
    def current_turn(self) -> int:
        return eviction.current_turn(self._messages)

    def messages(self) -> list[MessageRecord]:
        """Every message of the session, in order, whatever its state."""
        return list(self._messages)

    def live_messages(self) -> list[MessageRecord]:
        return [m for m in self._messages if m.state == "live"]

    def context_tokens(self) -> int:
        """Tokens of the prompt as it stands (without a generation prompt)."""
        return sum(self._layout()[1].values())

    def turn_map(self) -> list[TurnInfo]:
        return turn_map_of(self._messages)

    # -- adding messages ----------------------------------------------------------------------

    def add_user(self, content: str) -> MessageRecord:
        return self._add("user", content, self.current_turn + 1)

    def add_assistant(self, content: str, interrupted: bool = False) -> MessageRecord:
        return self._add("assistant", content, max(self.current_turn, 1), interrupted=interrupted)

    def add_tool(self, content: str) -> MessageRecord:
        return self._add("tool", content, max(self.current_turn, 1))

    def _add(
        self, role: str, content: str, turn: int, kind: str = "chat", interrupted: bool = False
    ) -> MessageRecord:
        tokens = self.renderer.count(role, content)
        message = self.store.add_message(
            self.session.id,
            role=role,
            content=content,
            token_count=tokens,
            turn=turn,
            kind=kind,
            interrupted=interrupted,
        )
        self._messages.append(message)
        return message

    # -- commands -----------------------------------------------------------------------------

    def pin(self, turn: int, pinned: bool = True) -> list[MessageRecord]:
        """Pin (or unpin) every message of ``turn``; a pinned turn that had left comes back."""
        targets = [m for m in self._messages if m.turn == turn and m.kind == "chat"]
        if not targets:
            raise ValueError(f"there is no turn {turn} in this session (turns 1–{self.current_turn})")
        for m in targets:
            changes: dict[str, Any] = {"pinned": int(pinned)}
            if pinned and m.state != "live":
                changes["state"] = "live"
            self.store.set_message(m.id, **changes)
            m.pinned = pinned
            m.state = changes.get("state", m.state)
        return targets

    def unpin(self, turn: int) -> list[MessageRecord]:
        return self.pin(turn, pinned=False)

    def set_budget(self, spec: str | int | BudgetSpec) -> Budget:
        budget = self.budget.respec(spec, self.backend.bytes_per_token, self.backend.max_context_tokens)
        budget.check_fits(self._section_tokens_fixed())
        self._save_budget(budget)
        return budget

    def _save_budget(self, budget: Budget) -> None:
        self.store.update_session(self.session.id, budget_spec=budget.spec.text, budget_tokens=budget.tokens)
        self.session.budget_spec = budget.spec.text
        self.session.budget_tokens = budget.tokens
        self.budget = budget

    def _section_tokens_fixed(self) -> int:
        return self.renderer.count("system", self.session.system, first=True) + len(
            self.renderer.generation_prompt_ids
        )

    def search(self, query: str, limit: int = 5) -> list[SearchHit]:
        """Full-text search over this session's whole history (the agent's ``recall`` tool)."""
        return self.store.search(
            self.session.id, fts_query(query), limit, states=("live", "summarized", "evicted")
        )

    def compact(self, focus: str | None = None, trigger: str = "manual") -> CompactionEvent | None:
        """Summarize every completed, unpinned turn (a manual ``/compact``); None if none is live."""
        turns = eviction.compactable_turns(self._messages)
        if not turns:
            return None
        return self._compact(turns, trigger, focus)

    def clear(self) -> CompactionEvent | None:
        """Drop every unpinned message and the summary from the live context (all stay stored)."""
        live = eviction.evictable(self._messages)
        if not live and self._summary_text is None:
            return None
        start = time.perf_counter()
        before = self.context_tokens()
        ids = [m.id for m in live]
        next_seq = max((m.seq for m in self._messages), default=0) + 1
        event = self.store.record_compaction(
            CompactionEvent(
                session_id=self.session.id,
                trigger="clear",
                focus=None,
                turns=sorted({m.turn for m in live}) or [self.current_turn],
                tokens_before=before,
                tokens_after=self._tokens_without(set(ids), None),
                summarized_ids=[],
                evicted_ids=ids,
                summary_text=None,
                window_start=next_seq,
                duration_ms=elapsed_ms(start),
            )
        )
        self._apply(set(), set(ids), None, event.summary_id, next_seq)
        self._emit(event)
        return event

    # -- the next prompt ----------------------------------------------------------------------

    def next_prompt(self) -> BuiltPrompt:
        """The prompt for the pending request: compacted if needed, with recall for a new message.

        Recall is searched first so that its note counts in the projection: a note that would
        push the prompt past the high watermark triggers the compaction, rather than being cut.
        """
        self._check_turn_fits()
        compactions: list[CompactionEvent] = []
        found = self._find_recall() if self.recall_enabled else None
        note_tokens = self.renderer.count("system", found.note) if found is not None else 0
        if self._projected_tokens() + note_tokens > self.budget.high_tokens:
            event = self._auto_compact()
            if event is not None:
                compactions.append(event)
                found = self._find_recall() if self.recall_enabled else None  # more has left
        recalled: list[SearchHit] = []
        if found is not None:
            self._add("system", found.note, found.turn, kind="recall")
            recalled = found.hits
        ordered, sections = self._layout()
        messages, ids = render(
            self.renderer, self.session.system, self._summary_text, ordered, self.session.window_start
        )
        ids = ids + self.renderer.generation_prompt_ids
        sections["new"] += len(self.renderer.generation_prompt_ids)
        self.budget.check_prompt_fits(len(ids))
        room = self.budget.tokens - len(ids)
        return BuiltPrompt(ids, messages, sections, room, self.budget.tokens, recalled, compactions)

    def _check_turn_fits(self) -> None:
        """Refuse, before compacting anything, a turn that no compaction could make fit.

        What compaction cannot remove is the system prompt, the pinned messages and the turn
        being answered; if they alone leave no room for one generated token, summarizing the
        rest of the conversation would only cost time and lose its live context for nothing.
        """
        pending = eviction.pending_turn(self._messages)
        if pending is None:
            return
        self.budget.check_prompt_fits(
            self._section_tokens_fixed() + eviction.unevictable_tokens(self._messages, pending)
        )

    def _auto_compact(self) -> CompactionEvent | None:
        old_summary = summary_tokens(self.renderer, self._summary_text) if self._summary_text else 0
        turns = eviction.auto_compact_turns(
            self._messages,
            self.budget,
            self.context_tokens(),
            len(self.renderer.generation_prompt_ids),
            old_summary,
            self.summarizer.max_summary_tokens,
        )
        if not turns:
            return None
        return self._compact(turns, "auto", None)

    def _compact(self, turns: list[int], trigger: str, focus: str | None) -> CompactionEvent:
        start = time.perf_counter()
        before = self.context_tokens()
        leaving = eviction.leaving(self._messages, turns)
        to_summarize = [m for m in leaving if m.kind == "chat"]
        evicted = [m for m in leaving if m.kind != "chat"]  # recall notes: copies of stored text
        cap = int(self.budget.tokens * self.budget.summary_share)
        covered: list[int] = []
        if self.session.summary_id is not None:
            covered = self.store.get_summary(self.session.summary_id).message_ids
        already = set(covered)  # a pinned turn that came back and was compacted again
        covered += [m.id for m in to_summarize if m.id not in already]
        summary_text, result, ledger, num_folded = self._summarize(covered, to_summarize, cap, focus)
        window_start = eviction.window_start_after(
            self._messages, leaving, turns[-1], self.session.window_start
        )
        summarized_ids = {m.id for m in to_summarize}
        evicted_ids = {m.id for m in evicted}
        after = self._tokens_without(summarized_ids | evicted_ids, summary_text)
        event = self.store.record_compaction(
            CompactionEvent(
                session_id=self.session.id,
                trigger=trigger,
                focus=focus,
                turns=turns,
                tokens_before=before,
                tokens_after=after,
                summarized_ids=sorted(summarized_ids),
                evicted_ids=sorted(evicted_ids),
                summary_text=summary_text,
                summary_message_ids=covered,
                summary_tokens=summary_tokens(self.renderer, summary_text),
                summary_depth=result.depth,
                previous_summary_id=self.session.summary_id,
                window_start=window_start,
                num_requests=result.num_requests,
                ledger=[f.to_dict() for f in ledger],
                num_facts_folded=num_folded,
                duration_ms=elapsed_ms(start),
            )
        )
        self._apply(summarized_ids, evicted_ids, summary_text, event.summary_id, window_start)
        self._emit(event)
        return event

    def _summarize(
        self, covered: list[int], to_summarize: list[MessageRecord], cap: int, focus: str | None
    ) -> tuple[str, SummaryResult, list[Fact], int]:
        """The new summary text (the model's prose and the kept-verbatim list, ``cap`` tokens in all
        as the prompt carries it), the summarizer's result, the facts listed and how many were
        folded out of the list for room.

        The list is sized first, from the facts of every message the summary covers, newest
        kept: the ledger is what must survive whatever the model writes, so the prose gets
        what the list leaves. Facts the prose states are then not repeated.
        """
        by_id = {m.id: m for m in self._messages}
        sources = sorted((by_id[i] for i in covered if i in by_id), key=lambda m: m.seq)
        facts = ledger_of(sources, self._facts_of)
        header = summary_tokens(self.renderer, "")  # the summary's header and template framing
        fitted = fit_ledger(facts, int(cap * LEDGER_SHARE), self._count_text)
        listed = self._count_text("\n\n" + render_ledger(fitted)) if fitted else 0
        result = self.summarizer.summarize(
            prose_of(self._summary_text), to_summarize, self.budget.tokens, cap - header - listed, focus
        )
        kept = [f for f in fitted if not states(result.text, f)]
        text = join_summary(result.text, kept)
        while kept and summary_tokens(self.renderer, text) > cap:  # token counts of parts add up
            kept.pop(0)  # only nearly; the oldest fact gives way
            text = join_summary(result.text, kept)
        num_folded = sum(1 for f in facts if f not in kept and not states(result.text, f))
        return text, result, kept, num_folded

    def _facts_of(self, message: MessageRecord) -> list[Fact]:
        if message.id not in self._facts:
            self._facts[message.id] = extract_facts(message)
        return self._facts[message.id]

    def _count_text(self, text: str) -> int:
        return len(self.renderer.encode(text))

    def _apply(
        self,
        summarized: set[int],
        evicted: set[int],
        summary: str | None,
        summary_id: int | None,
        window_start: int,
    ) -> None:
        """Change the live context to what the store now says (called only after it says so)."""
        for m in self._messages:
            if m.id in summarized:
                m.state = "summarized"
            elif m.id in evicted:
                m.state = "evicted"
        self._summary_text = summary
        self.session.summary_id = summary_id
        self.session.window_start = window_start

    def _tokens_without(self, leaving: set[int], summary: str | None) -> int:
        """What :meth:`context_tokens` will be once ``leaving`` has left and ``summary`` is in."""
        summary_size = summary_tokens(self.renderer, summary) if summary is not None else 0
        live = sum(m.token_count for m in self._messages if m.state == "live" and m.id not in leaving)
        return self.renderer.count("system", self.session.system, first=True) + summary_size + live

    def _projected_tokens(self) -> int:
        """KV the next request would hold: the prompt as it stands plus the reply's reserve."""
        return self.context_tokens() + len(self.renderer.generation_prompt_ids) + self.budget.reserve_tokens

    def _find_recall(self) -> Recall | None:
        """Evicted messages relevant to a new, not yet recalled-for user message (no side effects)."""
        left = [m for m in self._messages if m.state != "live" and m.kind == "chat"]
        return recall_for_new_message(
            self.store,
            self.session.id,
            self.session.system,
            self._messages,
            int(self.budget.tokens * self.budget.recall_share),
            lambda text: self.renderer.count("system", text),
            ledger=ledger_of(left, self._facts_of) if self.ledger_recall else (),
        )

    # -- rendering ----------------------------------------------------------------------------

    def _layout(self) -> tuple[list[MessageRecord], dict[str, int]]:
        """The live messages in prompt order, and the tokens of each section."""
        pending = eviction.pending_turn(self._messages)
        system, summary, window = self.session.system, self._summary_text, self.session.window_start
        return layout(self.renderer, system, summary, self._messages, window, pending)

    # -- events -------------------------------------------------------------------------------

    def _emit(self, event: CompactionEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _observe_request(self, kind: str, metrics: RequestMetrics, kv_tokens: int) -> None:
        if self.on_request is not None:
            self.on_request(kind, metrics, kv_tokens)


__all__ = ["SECTIONS", "BuiltPrompt", "ContextManager", "StoreError", "TurnInfo"]
