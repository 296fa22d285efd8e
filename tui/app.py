"""``liubai chat``: the Textual app, and :func:`run_chat`, its front door from the CLI.

:func:`run_chat` opens the store, the backend and the session before the app starts, so a bad
flag, an unknown ``--session`` or a model that will not load ends with one ``liubai: error:``
line (exit 1) instead of a half-drawn screen, and a model pull can show its progress on the
plain terminal. :class:`LiubaiApp` takes an already-open :class:`AgentSession`, which is also how
the tests give it one (a real engine, or a stand-in backend).

Keys: Ctrl-C cancels a streaming reply; when nothing streams, a second Ctrl-C within
``QUIT_WINDOW_S`` quits with exit code 130. Ctrl-Q quits (exit 0). Either way a reply still
streaming is cancelled first, and :func:`run_chat` waits for the worker to store it.
"""

import sys
import time

from textual.app import App
from textual.binding import Binding

from agent.config import AgentConfig
from agent.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, error_line
from agent.session import AgentSession
from memory.errors import MemoryLayerError
from runtime.errors import EngineError
from tui.screens.chat import ChatScreen

QUIT_WINDOW_S = 2.0
STORE_WAIT_S = 30.0  # at exit, how long to wait for a cancelled reply to be stored


class LiubaiApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "liubai"
    BINDINGS = [
        Binding("ctrl+c", "interrupt", "Cancel", priority=True, tooltip="cancel the reply; twice to quit"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, session: AgentSession) -> None:
        super().__init__()
        self.session = session
        self.sub_title = f"{session.backend.model_name} · session {session.session_id}"
        self._quit_armed_at: float | None = None
        self.chat = ChatScreen(session)

    def on_mount(self) -> None:
        self.push_screen(self.chat)

    def action_interrupt(self) -> None:
        if self.chat.cancel_reply():
            self._quit_armed_at = None
            return
        now = time.monotonic()
        if self._quit_armed_at is not None and now - self._quit_armed_at <= QUIT_WINDOW_S:
            self._stop(EXIT_INTERRUPTED)
            return
        self._quit_armed_at = now
        self.notify("press Ctrl-C again to quit (or Ctrl-Q)", timeout=QUIT_WINDOW_S)

    async def action_quit(self) -> None:
        self._stop(EXIT_OK)

    def _stop(self, return_code: int) -> None:
        self.chat.cancel_reply()
        self.exit(return_code=return_code)

    def wait_until_stored(self, timeout: float = STORE_WAIT_S) -> bool:
        """After the app exits: wait for a cancelled job to finish writing to the store."""
        return self.chat.idle.wait(timeout)


def open_session(config: AgentConfig, session_id: str | None) -> AgentSession:
    """The store, the backend and the session, opened in the order that fails fastest."""
    from agent.backends import open_backend
    from memory.store import Store

    store = Store(config.db)
    if session_id is not None:
        store.get_session(session_id)  # an unknown id fails before the model loads
    print(f"liubai: loading {config.model}…", file=sys.stderr, flush=True)
    backend = open_backend(config)
    return AgentSession.open(backend, store, config, session_id)


def run_chat(config: AgentConfig, session_id: str | None) -> int:
    """Run the chat; 0 when quit, 1 when the session could not start, 130 after Ctrl-C twice."""
    try:
        session = open_session(config, session_id)
    except (EngineError, MemoryLayerError, ValueError) as exc:
        print(error_line(exc), file=sys.stderr)
        return EXIT_FAILURE
    app = LiubaiApp(session)
    try:
        app.run()
    finally:
        if app.wait_until_stored():  # a worker still writing keeps its connection
            session.store.close()
    return app.return_code or EXIT_OK
