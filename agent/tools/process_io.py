"""Running a shell command and writing a file safely: the two side effects the tools allow.

Kept apart from ``agent/tools/registry.py`` (which decides *whether* a tool may run) because these are
about *how*: a command's whole process group dies on timeout and its output is capped as it is
read, and a file is replaced by rename so a reader never sees half of it.
"""

import os
import selectors
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ShellOutcome:
    output: bytes  # stdout and stderr interleaved, at most the cap
    num_bytes_cut: int
    returncode: int | None  # None when it timed out
    timed_out: bool


def run_shell(command: str, *, cwd: Path, timeout_s: float, cap_bytes: int) -> ShellOutcome:
    """Run ``command`` with ``/bin/sh -c``: stdin closed, output capped as it is read.

    The command gets its own session, so on timeout the whole process group (background
    jobs included) is killed. Output is read incrementally and everything past the cap is
    counted, not kept, so a runaway command cannot fill memory before its timeout.
    """
    deadline = time.monotonic() + timeout_s
    kept = bytearray()
    num_bytes = 0
    proc = subprocess.Popen(
        ["/bin/sh", "-c", command],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    timed_out = False
    with proc, selectors.DefaultSelector() as selector:
        fd = proc.stdout.fileno()
        selector.register(fd, selectors.EVENT_READ)
        while True:  # until EOF: every writer (the shell and its children) has exited
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            num_bytes += len(chunk)
            kept += chunk[: max(0, cap_bytes - len(kept))]
        if not timed_out:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # closed its output but kept running
                timed_out = True
        if timed_out:
            _kill_group(proc)
    return ShellOutcome(
        output=bytes(kept),
        num_bytes_cut=num_bytes - len(kept),
        returncode=None if timed_out else proc.returncode,
        timed_out=timed_out,
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is already gone
        pass
    proc.wait()


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old file or the new, never half.

    The temporary file sits beside the target (same filesystem, so the rename is atomic),
    is created with the umask applied, and takes over an existing file's permission bits.
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
