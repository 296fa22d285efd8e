"""``liubai chat`` in a real terminal: tmux runs the console script, the test types and reads the screen.

This is the one test that goes through the CLI, a pseudo-terminal and Textual's real driver, so
it catches what the pilot cannot (the entry point, key decoding, drawing). It runs on its own
tmux server socket, so it never touches a user's sessions, and is skipped where tmux is missing.
"""

import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memory.store import Store

WIDTH, HEIGHT = 130, 40
TIMEOUT_S = 120.0

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


class Tmux:
    def __init__(self, socket: str, session: str) -> None:
        self.socket = socket
        self.session = session

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=check, timeout=30
        )

    def screen(self) -> str:
        result = self("capture-pane", "-p", "-t", self.session, check=False)
        return result.stdout

    def alive(self) -> bool:
        return self("has-session", "-t", self.session, check=False).returncode == 0

    def wait_for(self, what: str, condition: Callable[[str], bool], timeout: float = TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline and self.alive():
            screen = self.screen()
            if condition(screen):
                return screen
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; the screen was:\n{screen}")


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    term = Tmux(f"liubai-test-{uuid.uuid4().hex[:8]}", "chat")
    yield term
    term("kill-server", check=False)


def test_chat_in_a_real_terminal(tmux: Tmux, tmp_path: Path) -> None:
    db = tmp_path / "chat.db"
    exit_file = tmp_path / "exit-code"
    liubai = Path(sys.executable).parent / "liubai"
    # --weights float32: `auto` would first time every format on one thread (its plan is keyed
    # by the thread count, so the suite's plan does not serve it), minutes on a slow CPU and
    # not this test's subject (tests/test_weight_plan.py is).
    command = (
        f"env LIUBAI_DATA_DIR={tmp_path / 'data'} OMP_NUM_THREADS=1 TERM=xterm-256color "
        f"{liubai} chat --max-tokens 12 --no-tools --weights float32 --db {db}; "
        f"echo $? > {exit_file}"
    )
    tmux("new-session", "-d", "-s", tmux.session, "-x", str(WIDTH), "-y", str(HEIGHT), command)

    tmux.wait_for("the app", lambda s: "Enter sends" in s and "KV budget" in s)
    tmux("send-keys", "-t", tmux.session, "-l", "What is the capital of France?")
    tmux("send-keys", "-t", tmux.session, "Enter")
    screen = tmux.wait_for(
        "the reply and the gauge", lambda s: "liubai · turn 1" in s and "last request" in s
    )

    tmux("send-keys", "-t", tmux.session, "C-q")
    deadline = time.monotonic() + 30
    while (tmux.alive() or not exit_file.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tmux.alive(), "Ctrl-Q should end the app and with it the tmux session"
    assert exit_file.read_text().strip() == "0"

    store = Store(db)
    (session,) = store.list_sessions()
    answer = [m for m in store.messages(session.id) if m.role == "assistant"][-1].content
    request = store.requests(session.id)[-1]
    assert "What is the capital of France?" in screen
    first_words = " ".join(answer.split()[:3])
    assert first_words and first_words in " ".join(screen.split())
    assert f"{request['kv_tokens']:,} / {request['budget_tokens']:,} tok" in screen
