"""What the model sees of a conversation, kept inside the session's KV budget.

The prompt is laid out as::

    [system] [pinned] [summary] [recent turns ... [recalled] [new message]]

``pinned`` holds the pinned messages that outlived their turns' compaction, ``summary`` the
model-written summary of everything compacted so far, and each turn's recall note sits directly
before the user message it was recalled for (see ``memory/recall.py`` for why). Between
compactions every prompt is the previous prompt plus the reply plus the new turn, token for
token, so the engine's prefix cache serves all of the history and prefills only the new turn.

Every message is written to the store when it is added, and a compaction is written (summary,
record, new message states) before the live context changes, so nothing is lost whenever the
process stops.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memory.budget import Budget, BudgetSpec
from memory.chat_render import renderer_for
from memory.compaction import CompactionEvent, elapsed_ms
from memory.errors import BudgetError, StoreError
from memory.recall import Recall, recall_for
from memory.records import MessageRecord, SearchHit, SessionRecord
from memory.store import Store
from memory.summarizer import Summarizer
from runtime.backends.backend import Backend, ChatPrompt
from runtime.engine.metrics import RequestMetrics

SECTIONS = ("system", "pinned", "summary", "recalled", "recent", "new")
SUMMARY_HEADER = "Summary of the earlier conversation:\n"
DEFAULT_SYSTEM = "You are a helpful assistant."

EventObserver = Callable[[CompactionEvent], None]
RequestObserver = Callable[[str, RequestMetrics, int], None]


@dataclass(slots=True)
class BuiltPrompt:
    """The next request's prompt, with the tokens each section of the layout takes."""

    token_ids: list[int]
    messages: list[dict[str, str]]
    sections: dict[str, int]
    max_tokens: int  # the most the reply may generate without passing the budget
    budget_tokens: int
    recalled: list[SearchHit] = field(default_factory=list)
    compactions: list[CompactionEvent] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chat_prompt(self) -> ChatPrompt:
        return ChatPrompt(self.messages, self.token_ids)


@dataclass(slots=True)
class TurnInfo:
    """One row of the turn map: a user turn and what became of it."""

    turn: int
    state: str  # live / summarized / evicted
    pinned: bool
    tokens: int
    preview: str


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
        max_summary_tokens: int = 192,
        on_event: EventObserver | None = None,
        on_request: RequestObserver | None = None,
    ) -> None:
        self.store = store
        self.backend = backend
        self.session = session
        self.renderer = renderer_for(backend.tokenizer, backend.model_name)
        self.recall_enabled = recall
        self.on_event = on_event
        self.on_request = on_request
        self.summarizer = Summarizer(backend, self.renderer, max_summary_tokens, self._observe_request)
        self._messages: list[MessageRecord] = store.messages(session.id)
        self._summary_text: str | None = None
        if session.summary_id is not None:
            self._summary_text = store.get_summary(session.summary_id).text
        self.budget = budget
        self._check_budget(budget)

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
        _check_fits(
            parsed, renderer.count("system", system, first=True) + len(renderer.generation_prompt_ids)
        )
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
        return max((m.turn for m in self._messages), default=0)

    def messages(self) -> list[MessageRecord]:
        """Every message of the session, in order, whatever its state."""
        return list(self._messages)

    def live_messages(self) -> list[MessageRecord]:
        return [m for m in self._messages if m.state == "live"]

    def context_tokens(self) -> int:
        """Tokens of the prompt as it stands (without a generation prompt)."""
        return sum(self._layout()[1].values())

    def turn_map(self) -> list[TurnInfo]:
        turns: dict[int, TurnInfo] = {}
        for m in self._messages:
            if m.kind != "chat" or m.turn == 0:
                continue
            info = turns.get(m.turn)
            if info is None:
                preview = " ".join(m.content.split())[:60]
                info = turns[m.turn] = TurnInfo(m.turn, m.state, m.pinned, 0, preview)
            info.tokens += m.token_count
            info.pinned = info.pinned or m.pinned
            if m.state == "live":
                info.state = "live"
        return [turns[t] for t in sorted(turns)]

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
        budget = Budget.from_spec(
            spec,
            self.backend.bytes_per_token,
            self.backend.max_context_tokens,
            high_watermark=self.budget.high_watermark,
            low_watermark=self.budget.low_watermark,
            reserve_tokens=self.budget.reserve_tokens,
            recall_share=self.budget.recall_share,
            summary_share=self.budget.summary_share,
        )
        self._check_budget(budget)
        self._save_budget(budget)
        return budget

    def _save_budget(self, budget: Budget) -> None:
        self.store.update_session(self.session.id, budget_spec=budget.spec.text, budget_tokens=budget.tokens)
        self.session.budget_spec = budget.spec.text
        self.session.budget_tokens = budget.tokens
        self.budget = budget

    def _check_budget(self, budget: Budget) -> None:
        _check_fits(budget, self._section_tokens_fixed())

    def _section_tokens_fixed(self) -> int:
        return self.renderer.count("system", self.session.system, first=True) + len(
            self.renderer.generation_prompt_ids
        )

    def search(self, query: str, limit: int = 5) -> list[SearchHit]:
        """Full-text search over this session's whole history (the agent's ``recall`` tool)."""
        from memory.recall import fts_query

        return self.store.search(
            self.session.id, fts_query(query), limit, states=("live", "summarized", "evicted")
        )

    def compact(self, focus: str | None = None, trigger: str = "manual") -> CompactionEvent | None:
        """Summarize every completed, unpinned turn (a manual ``/compact``); None if none is live."""
        keep_from = self._pending_turn()
        turns = sorted({m.turn for m in self._evictable() if keep_from is None or m.turn < keep_from})
        if not turns:
            return None
        return self._compact(turns, trigger, focus)

    def clear(self) -> CompactionEvent | None:
        """Drop every unpinned message and the summary from the live context (all stay stored)."""
        live = [m for m in self._messages if m.state == "live" and not m.pinned]
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
        messages, sections, ids = self._render()
        ids = ids + self.renderer.generation_prompt_ids
        sections["new"] += len(self.renderer.generation_prompt_ids)
        room = self.budget.tokens - len(ids)
        if room < 1:
            raise self._too_big(len(ids))
        return BuiltPrompt(ids, messages, sections, room, self.budget.tokens, recalled, compactions)

    def _check_turn_fits(self) -> None:
        """Refuse, before compacting anything, a turn that no compaction could make fit.

        What compaction cannot remove is the system prompt, the pinned messages and the turn
        being answered; if they alone leave no room for one generated token, summarizing the
        rest of the conversation would only cost time and lose its live context for nothing.
        """
        pending = self._pending_turn()
        if pending is None:
            return
        kept = sum(
            m.token_count for m in self._messages if m.state == "live" and (m.pinned or m.turn == pending)
        )
        need = self._section_tokens_fixed() + kept
        if need >= self.budget.tokens:
            raise self._too_big(need)

    def _too_big(self, num_tokens: int) -> BudgetError:
        return BudgetError(
            f"the prompt needs {num_tokens:,} tokens but the KV budget holds {self.budget.tokens:,} "
            f"({self.budget.spec.text}); the current turn and the pinned turns alone do not fit — "
            "raise the budget or unpin turns"
        )

    def _pending_turn(self) -> int | None:
        """The turn being answered (its user message is the last user message and unanswered)."""
        chat = [m for m in self._messages if m.kind == "chat"]
        if not chat:
            return None
        last_user = max((m.turn for m in chat if m.role == "user"), default=None)
        if last_user is None:
            return None
        answered = any(m.turn == last_user and m.role == "assistant" for m in chat)
        last = chat[-1]
        if answered and last.role == "assistant":
            return None
        return last_user

    def _evictable(self) -> list[MessageRecord]:
        return [m for m in self._messages if m.state == "live" and not m.pinned]

    def _auto_compact(self) -> CompactionEvent | None:
        keep_from = self._pending_turn() or self.current_turn + 1
        candidates = self._evictable()
        turns = sorted({m.turn for m in candidates if m.turn < keep_from})
        if not turns:
            return None
        target = (
            self.budget.low_tokens - self.budget.reserve_tokens - len(self.renderer.generation_prompt_ids)
        )
        summary_cap = int(self.budget.tokens * self.budget.summary_share)
        total = self.context_tokens()
        old_summary = (
            self.renderer.count("system", SUMMARY_HEADER + self._summary_text) if self._summary_text else 0
        )
        # The new summary is expected to be about as long as the one it replaces (the model is
        # asked for the same length each time); the first one may take all it is allowed. Taking
        # the allowance every time evicted a few turns too many whenever summaries came out short.
        longest = min(self.summarizer.max_summary_tokens, summary_cap) + 8
        expected_summary = min(longest, max(old_summary + 32, 64)) if old_summary else longest
        served = sum(m.token_count for m in self._served_notes())
        chosen: list[int] = []
        for turn in turns:
            chosen.append(turn)
            freed = served + sum(m.token_count for m in candidates if m.turn in chosen and m.kind == "chat")
            if total - freed - old_summary + expected_summary <= target:
                break
        return self._compact(chosen, "auto", None)

    def _served_notes(self) -> list[MessageRecord]:
        """Recall notes of answered turns: they leave at every compaction, whichever turns go.

        A note is there for the reply to its question; once that reply exists, the note is a
        verbatim copy of stored text taking budget from live turns (a conversation that recalls
        often would otherwise keep fewer turns live than one that does not). Dropping it at a
        compaction costs no prefix-cache hits, since everything after the summary is re-read
        then anyway, and the next question that needs it recalls it again.
        """
        answering = self._pending_turn() or self.current_turn + 1
        return [m for m in self._evictable() if m.kind == "recall" and m.turn < answering]

    def _compact(self, turns: list[int], trigger: str, focus: str | None) -> CompactionEvent:
        start = time.perf_counter()
        before = self.context_tokens()
        turn_set = set(turns)
        served = {m.id for m in self._served_notes()}
        leaving = [m for m in self._evictable() if m.turn in turn_set or m.id in served]
        to_summarize = [m for m in leaving if m.kind == "chat"]
        evicted = [m for m in leaving if m.kind != "chat"]  # recall notes: copies of stored text
        cap = int(self.budget.tokens * self.budget.summary_share)
        result = self.summarizer.summarize(self._summary_text, to_summarize, self.budget.tokens, cap, focus)
        covered: list[int] = []
        if self.session.summary_id is not None:
            covered = self.store.get_summary(self.session.summary_id).message_ids
        already = set(covered)  # a pinned turn that came back and was compacted again
        covered += [m.id for m in to_summarize if m.id not in already]
        # The recent section now starts at the first live message after the compacted turns;
        # pinned turns up to the last compacted one (pinned turns are never compacted, so they
        # may sit between compacted ones) move in front of the summary, into the pinned section.
        remaining = [m for m in self._messages if m.state == "live" and m not in leaving]
        window_start = min(
            (
                m.seq
                for m in remaining
                if m.seq >= self.session.window_start and not (m.pinned and m.turn <= turns[-1])
            ),
            default=max((m.seq for m in self._messages), default=0) + 1,
        )
        summarized_ids = {m.id for m in to_summarize}
        evicted_ids = {m.id for m in evicted}
        after = self._tokens_without(summarized_ids | evicted_ids, result.text)
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
                summary_text=result.text,
                summary_message_ids=covered,
                summary_tokens=self.renderer.count("system", SUMMARY_HEADER + result.text),
                summary_depth=result.depth,
                previous_summary_id=self.session.summary_id,
                window_start=window_start,
                num_requests=result.num_requests,
                duration_ms=elapsed_ms(start),
            )
        )
        self._apply(summarized_ids, evicted_ids, result.text, event.summary_id, window_start)
        self._emit(event)
        return event

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
        summary_tokens = self.renderer.count("system", SUMMARY_HEADER + summary) if summary is not None else 0
        live = sum(m.token_count for m in self._messages if m.state == "live" and m.id not in leaving)
        return self.renderer.count("system", self.session.system, first=True) + summary_tokens + live

    def _projected_tokens(self) -> int:
        """KV the next request would hold: the prompt as it stands plus the reply's reserve."""
        return self.context_tokens() + len(self.renderer.generation_prompt_ids) + self.budget.reserve_tokens

    def _find_recall(self) -> Recall | None:
        """Evicted messages relevant to a new, not yet recalled-for user message (no side effects)."""
        chat = [m for m in self._messages if m.kind == "chat"]
        if not chat or chat[-1].role != "user" or chat[-1].state != "live":
            return None
        new = chat[-1]
        if any(m.kind == "recall" and m.turn == new.turn for m in self._messages):
            return None  # already recalled (a tool round of the same turn)
        live = [m for m in self._messages if m.state == "live" and m.id != new.id]
        return recall_for(
            self.store,
            self.session.id,
            new.content,
            new.turn,
            int(self.budget.tokens * self.budget.recall_share),
            lambda text: self.renderer.count("system", text),
            [m.content for m in live if m.kind == "recall"],
            live_texts=[self.session.system, *(m.content for m in live if m.kind == "chat")],
        )

    # -- rendering ----------------------------------------------------------------------------

    def _layout(self) -> tuple[list[MessageRecord], dict[str, int]]:
        """The live messages in prompt order, and the tokens of each section."""
        sections = dict.fromkeys(SECTIONS, 0)
        sections["system"] = self.renderer.count("system", self.session.system, first=True)
        if self._summary_text is not None:
            sections["summary"] = self.renderer.count("system", SUMMARY_HEADER + self._summary_text)
        pending = self._pending_turn()
        window = self.session.window_start
        front = [m for m in self._messages if m.state == "live" and m.seq < window]
        recent = [m for m in self._messages if m.state == "live" and m.seq >= window]
        # Within a turn a recall note goes before the user message it was made for.
        recent.sort(key=lambda m: (m.turn, m.kind != "recall", m.seq))
        for m in front:
            sections["pinned"] += m.token_count
        for m in recent:
            if m.turn == pending and m.kind == "recall":
                sections["recalled"] += m.token_count
            elif m.turn == pending:
                sections["new"] += m.token_count
            else:
                sections["recent"] += m.token_count
        return front + recent, sections

    def _render(self) -> tuple[list[dict[str, str]], dict[str, int], list[int]]:
        ordered, sections = self._layout()
        messages = [{"role": "system", "content": self.session.system}]
        ids = list(self.renderer.message_ids("system", self.session.system, first=True))
        window = self.session.window_start
        summary_done = self._summary_text is None
        for m in ordered:
            if not summary_done and m.seq >= window:
                summary_done = self._render_summary(messages, ids)
            messages.append({"role": m.role, "content": m.content})
            ids += self.renderer.message_ids(m.role, m.content)
        if not summary_done:
            self._render_summary(messages, ids)
        return messages, sections, ids

    def _render_summary(self, messages: list[dict[str, str]], ids: list[int]) -> bool:
        assert self._summary_text is not None
        content = SUMMARY_HEADER + self._summary_text
        messages.append({"role": "system", "content": content})
        ids += self.renderer.message_ids("system", content)
        return True

    # -- events -------------------------------------------------------------------------------

    def _emit(self, event: CompactionEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _observe_request(self, kind: str, metrics: RequestMetrics, kv_tokens: int) -> None:
        if self.on_request is not None:
            self.on_request(kind, metrics, kv_tokens)


def _check_fits(budget: Budget, fixed_tokens: int) -> None:
    need = fixed_tokens + budget.reserve_tokens
    if need > budget.tokens:
        raise BudgetError(
            f"the KV budget {budget.spec.text} ({budget.tokens:,} tokens) is smaller than the system "
            f"prompt ({fixed_tokens:,} tokens) plus the reply reserve ({budget.reserve_tokens:,}); "
            f"raise it to at least {need:,}tok"
        )


__all__ = ["SECTIONS", "BuiltPrompt", "ContextManager", "StoreError", "TurnInfo"]
