"""The chat: the conversation and its input on the left, the live panel on the right.

The screen owns the session's one worker. A turn (or a ``/compact``, which also calls the model)
runs on a thread worker; the loop's events come back as messages (``tui/messages.py``) and the
handlers below update the widgets on the UI thread, so keys are handled while the model
generates. One job at a time: Enter while a reply streams is refused with a notification and the
text stays in the input. Commands that only change state (``/pin``, ``/budget``, ``/clear``,
``/export``) run on the UI thread, when no job runs, and ``/help`` and ``/stats`` run any time.

Every message is in the store before it is shown, so an error (shown as a notification) or a
crash loses nothing the store already has.
"""

import threading
import traceback

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Header, Input

from agent.errors import one_line
from agent.events import Event
from agent.session import AgentSession, TurnInterrupted
from memory.errors import MemoryLayerError
from runtime.engine.metrics import RequestMetrics
from runtime.errors import EngineError
from tui.command_palette import SlashCommandProvider
from tui.commands import CommandError, SlashCommand, is_command, parse_command
from tui.export import export_session
from tui.messages import (
    AgentFailed,
    CommandChosen,
    CompactionNoticed,
    ContextSnapshot,
    JobDone,
    PrefillInput,
    ReplyDelta,
    RequestBegan,
    RequestDone,
    ToolCallFinished,
    ToolCallStarted,
    TurnEnded,
    message_for,
)
from tui.screens.help import HelpScreen
from tui.screens.stats import StatsScreen, session_slope_text, stats_markdown
from tui.totals import SessionTotals
from tui.widgets.chat_log import ChatLog
from tui.widgets.kv_gauge import KVGauge, KVReading
from tui.widgets.latency_panel import LatencyPanel, LatencySample
from tui.widgets.pool_panel import PoolPanel, PrefixHits
from tui.widgets.turn_map import TurnMap

USER_ERRORS = (EngineError, MemoryLayerError, ValueError)
IDLE_HINT = "Message · Enter sends · /help for commands"
POLL_INTERVAL_S = 0.25  # the pool gauge's refresh while a job runs (~4 Hz)


class ChatScreen(Screen[None]):
    CSS_PATH = "chat.tcss"
    COMMANDS = {SlashCommandProvider}
    AUTO_FOCUS = "#prompt"
    BINDINGS = [Binding("f1", "help", "Help")]

    busy: reactive[str | None] = reactive(None)  # the running job: None, "turn" or "compact"

    def __init__(self, session: AgentSession) -> None:
        super().__init__()
        self.session = session
        self.totals = SessionTotals()
        self.hits = PrefixHits()
        self.idle = threading.Event()  # set whenever no job runs (run_chat waits on it at exit)
        self.idle.set()
        self._cancel = threading.Event()
        self._snapshot: ContextSnapshot = ContextSnapshot.of(session)
        self._prompt_tokens = 0
        self._num_streamed = 0

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="conversation"):
                yield ChatLog(id="chat-log")
                yield Input(placeholder=IDLE_HINT, id="prompt")
            with VerticalScroll(id="live-panel"):
                yield KVGauge(id="kv-gauge")
                yield PoolPanel(id="pool")
                yield LatencyPanel(id="latency")
                yield TurnMap(id="turn-map")
        yield Footer()

    async def on_mount(self) -> None:
        chat = self.query_one(ChatLog)
        messages = self.session.context.messages()
        if any(m.turn > 0 for m in messages):
            await chat.show_history(messages)
            self._seed_from_store()
            turns = self._snapshot.turns
            left = sum(t.state != "live" for t in turns)
            await chat.add_notice(
                f"resumed session {self.session.session_id}: {len(turns)} turns, {left} not live"
            )
        else:
            await chat.add_notice(f"new session with {self.session.backend.model_name} · /help for commands")
        backend = self.session.backend
        self.query_one(LatencyPanel).show_engine(backend.weight_format, backend.compiled)
        self._show_context(self._snapshot)
        self._poll_engine()
        self.set_interval(POLL_INTERVAL_S, self._poll_while_busy)

    def watch_busy(self, busy: str | None) -> None:
        hints = {None: IDLE_HINT, "turn": "replying… Ctrl-C cancels", "compact": "compacting…"}
        self.query_one("#prompt", Input).placeholder = hints[busy]

    def _seed_from_store(self) -> None:
        """A resumed session's figures: its stored requests' tokens, hits and latencies."""
        samples = []
        for row in self.session.store.requests(self.session.session_id):
            self.totals.add_row(row)
            self.hits = self.hits.add(int(row.get("cached_tokens") or 0), int(row.get("prompt_tokens") or 0))
            if row.get("kind") == "turn":
                spec = RequestMetrics(
                    num_drafts=int(row.get("num_drafts") or 0),
                    num_accepted_tokens=int(row.get("num_accepted_tokens") or 0),
                )
                samples.append(
                    LatencySample(
                        float(row.get("ttft_ms") or 0.0),
                        float(row.get("prefill_tok_s") or 0.0),
                        float(row.get("decode_tok_s") or 0.0),
                        spec.mean_accepted_length,
                    )
                )
        self.query_one(LatencyPanel).add(*samples)
        self.query_one(PoolPanel).hits = self.hits

    # -- input ----------------------------------------------------------------------------------

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if is_command(text):
            try:
                command = parse_command(text)
            except CommandError as exc:
                self.notify(str(exc), title="command", severity="error")
                return
            if await self.run_command(command):
                event.input.clear()
            return
        if self.busy is not None:
            self.notify(
                "one message at a time: wait for the reply, or press Ctrl-C to cancel it",
                title="busy",
                severity="warning",
            )
            return
        event.input.clear()
        await self.send(text)

    async def send(self, text: str) -> None:
        """Show the message and answer it on the worker."""
        self._start_job("turn")
        await self.query_one(ChatLog).add_user(text, self.session.context.current_turn + 1)
        self._run_turn(text)

    def cancel_reply(self) -> bool:
        """Ctrl-C: cancel the streaming reply; False when there is nothing to cancel."""
        if self.busy == "turn":
            self._cancel.set()
            self.notify("cancelling the reply…", timeout=2)
            return True
        if self.busy == "compact":
            self.notify("a compaction cannot be cancelled; it ends on its own", severity="warning", timeout=3)
            return True
        return False

    def on_prefill_input(self, message: PrefillInput) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.value = message.text
        prompt.cursor_position = len(message.text)
        prompt.focus()

    async def on_command_chosen(self, message: CommandChosen) -> None:
        await self.run_command(message.command)

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen())

    # -- commands -------------------------------------------------------------------------------

    async def run_command(self, command: SlashCommand) -> bool:
        """Carry out a slash command; False if it was refused or failed (the reason is notified)."""
        name = command.name
        if name == "help":
            self.action_help()
            return True
        if name == "stats":
            engine = self.session.backend.stats()
            markdown = stats_markdown(
                self.session.session_id,
                self.session.backend.model_name,
                self._snapshot,
                self.totals,
                engine,
                session_slope_text(self.session.store.path, self.session.session_id),
            )
            self.app.push_screen(StatsScreen(markdown))
            return True
        if self.busy is not None:
            self.notify(f"/{name} waits until the reply has finished (Ctrl-C cancels it)", severity="warning")
            return False
        session = self.session
        try:
            if name == "compact":
                self._start_job("compact")
                self._run_compact(command.argument)
                return True
            if name == "export":
                assert command.argument is not None
                count = export_session(session, command.argument)
                self.notify(f"exported {count} messages to {command.argument}")
            elif name == "pin":
                session.pin(command.turn)
                self.notify(f"pinned turn {command.turn}")
            elif name == "unpin":
                session.unpin(command.turn)
                self.notify(f"unpinned turn {command.turn}")
            elif name == "budget":
                assert command.argument is not None
                session.set_budget(command.argument)
                self.notify(f"KV budget {session.context.budget.describe()}")
            elif name == "clear":
                if session.clear(self._post_event) is None:
                    self.notify("nothing to clear")
        except (*USER_ERRORS, OSError) as exc:
            self.notify(one_line(exc), title=f"/{name}", severity="error")
            return False
        self._show_context(ContextSnapshot.of(session))
        return True

    # -- the worker -----------------------------------------------------------------------------

    def _start_job(self, job: str) -> None:
        self.busy = job
        self.idle.clear()
        self._cancel = threading.Event()

    @work(thread=True, exclusive=True, group="agent", exit_on_error=False)
    def _run_turn(self, text: str) -> None:
        interrupted = False
        try:
            self.session.run_turn(text, self._post_event, self._cancel)
        except TurnInterrupted:
            interrupted = True
        except USER_ERRORS as exc:
            self.post_message(AgentFailed(one_line(exc)))
        except Exception as exc:  # a bug: show it and keep going; the store already has the turn
            self.post_message(AgentFailed(f"internal error: {one_line(exc)}", traceback.format_exc()))
        finally:
            self._end_job("turn", interrupted)

    @work(thread=True, exclusive=True, group="agent", exit_on_error=False)
    def _run_compact(self, focus: str | None) -> None:
        note = None
        try:
            if self.session.compact(focus, self._post_event) is None:
                note = "nothing to compact: no completed, unpinned turn is live"
        except USER_ERRORS as exc:
            self.post_message(AgentFailed(one_line(exc)))
        except Exception as exc:
            self.post_message(AgentFailed(f"internal error: {one_line(exc)}", traceback.format_exc()))
        finally:
            self._end_job("compact", False, note)

    def _end_job(self, job: str, interrupted: bool, note: str | None = None) -> None:
        """Worker side: hand the final state to the UI, then let a waiting exit proceed."""
        try:
            self.post_message(JobDone(job, interrupted, ContextSnapshot.of(self.session), note))
        finally:
            self.idle.set()

    def _post_event(self, event: Event) -> None:
        """The loop's event sink (on the worker thread; also called by /clear on the UI thread)."""
        message = message_for(event, self.session)
        if message is not None:
            self.post_message(message)

    # -- the agent's messages -------------------------------------------------------------------

    def on_request_began(self, message: RequestBegan) -> None:
        self._prompt_tokens = message.event.prompt_tokens
        self._num_streamed = 0
        self._show_context(message.context, message.event.prompt_tokens, "streaming")

    async def on_reply_delta(self, message: ReplyDelta) -> None:
        self._num_streamed += 1
        await self.query_one(ChatLog).write_reply(message.event.turn, message.event.text)
        self._show_kv(self._prompt_tokens + self._num_streamed, "streaming")

    async def on_tool_call_started(self, message: ToolCallStarted) -> None:
        await self.query_one(ChatLog).add_tool_call(message.event.name, message.event.arguments)

    async def on_tool_call_finished(self, message: ToolCallFinished) -> None:
        e = message.event
        await self.query_one(ChatLog).finish_tool_call(e.name, e.ok, e.refused, e.truncated, e.content)

    async def on_compaction_noticed(self, message: CompactionNoticed) -> None:
        await self.query_one(ChatLog).add_notice(f"⟲ {message.event.description}", "compaction")
        self._show_context(message.context)

    def on_request_done(self, message: RequestDone) -> None:
        e = message.event
        self.totals.add_event(e.kind, e.metrics, e.cost)
        self.hits = self.hits.add(int(e.metrics["num_cached_tokens"]), int(e.metrics["num_prompt_tokens"]))
        self.query_one(PoolPanel).hits = self.hits
        if e.kind == "turn":
            m = e.metrics
            sample = LatencySample(
                float(m["ttft_ms"]),
                float(m["prefill_tok_s"]),
                float(m["decode_tok_s"]),
                float(m.get("mean_accepted_length") or 0.0),
            )
            latency = self.query_one(LatencyPanel)
            latency.add(sample)
            latency.show_engine(e.kv.get("weights"), e.kv.get("compiled"))
        if e.kind != "summary":
            self._show_kv(int(e.kv["tokens"]), "last request")

    async def on_turn_ended(self, message: TurnEnded) -> None:
        e = message.event
        await self.query_one(ChatLog).end_reply(e.turn, e.answer, e.interrupted)
        tokens = int(e.kv.get("tokens") or 0)
        if tokens:
            self._show_context(message.context, tokens, "last request")
        else:  # cancelled before the engine reported: the context as it now stands
            self._show_context(message.context)

    def on_agent_failed(self, message: AgentFailed) -> None:
        if message.detail:
            self.log.error(message.detail)
        self.notify(message.message, title="error", severity="error", timeout=8)

    async def on_job_done(self, message: JobDone) -> None:
        chat = self.query_one(ChatLog)
        if chat.streaming:  # the job failed mid-reply: keep what streamed, closed
            await chat.end_reply(self.session.context.current_turn, "", interrupted=True)
        if self._gauge_source() == "streaming" or message.job == "compact":
            self._show_context(message.context)
        else:
            self._snapshot = message.context
            self.query_one(TurnMap).show(message.context.turns)
            self.query_one(ChatLog).mark_states({t.turn: t.state for t in message.context.turns})
        self.busy = None
        if message.interrupted:
            self.notify("reply cancelled; the partial reply is stored", timeout=3)
        if message.note:
            self.notify(message.note)
        self._poll_engine()

    # -- the live panel -------------------------------------------------------------------------

    def _show_context(
        self, context: ContextSnapshot, tokens: int | None = None, source: str = "context"
    ) -> None:
        self._snapshot = context
        self.query_one(TurnMap).show(context.turns)
        self.query_one(ChatLog).mark_states({t.turn: t.state for t in context.turns})
        self._show_kv(context.context_tokens if tokens is None else tokens, source)

    def _show_kv(self, tokens: int, source: str) -> None:
        c = self._snapshot
        gauge = self.query_one(KVGauge)
        high = self.session.context.budget.high_watermark
        gauge.reading = KVReading(
            tokens, c.budget_tokens, c.bytes_per_token, c.k_dtype, c.v_dtype, source, high
        )

    def _gauge_source(self) -> str | None:
        reading = self.query_one(KVGauge).reading
        return reading.source if reading is not None else None

    def _poll_while_busy(self) -> None:
        if self.busy is not None:
            self._poll_engine()

    def _poll_engine(self) -> None:
        self.query_one(PoolPanel).stats = self.session.backend.stats()
