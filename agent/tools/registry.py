"""The agent's tools: what the model may run, where it may look, and how much it gets back.

A :class:`ToolRegistry` runs :class:`~agent.tools.calls.ToolCall` values under a
:class:`ToolPermissions`. ``recall``, ``read_file`` and ``list_dir`` are always offered;
``shell`` and ``write_file`` only when the user allowed them (``--allow-tools shell,write``).
Every path is resolved with symlinks followed and must land inside the working directory or
one of the paths the user named, so ``..``, absolute paths and symlinks cannot escape.

:meth:`ToolRegistry.run` never raises for a tool-level problem (unknown tool, bad arguments,
refusal, missing file, timeout): tools raise :class:`ToolError` internally and ``run`` turns
it into a failed :class:`~agent.tools.result.ToolResult` whose content is the one-line reason
the model and the user both see. ``refused`` marks a permission or confinement refusal: nothing
was run.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.tools.calls import ToolCall
from agent.tools.process_io import run_shell, write_atomically
from agent.tools.result import ToolResult

OPTIONAL_TOOLS = ("shell", "write")

# The memory layer's search: (query, limit) -> hits with message_id, role, content, turn.
# It should raise ValueError for a query it cannot search; run() reports that to the model.
RecallFn = Callable[[str, int], list[dict[str, Any]]]

BINARY_SNIFF_BYTES = 8192
MAX_RECALL_HITS = 20


class ToolError(Exception):
    """A tool could not do what was asked; the message is the one-line reason."""


class ToolRefused(ToolError):
    """A call refused by permission or confinement; nothing was run."""


@dataclass(frozen=True, slots=True)
class ToolPermissions:
    """What the tools may do and where: the optional tools allowed, and the confinement.

    ``root`` is the working directory; ``extra_paths`` are files or directories the user
    named. Both are stored resolved (relative extra paths are relative to ``root``).
    """

    allowed: frozenset[str] = frozenset()  # of OPTIONAL_TOOLS
    root: Path = field(default_factory=Path.cwd)
    extra_paths: tuple[Path, ...] = ()
    shell_timeout_s: float = 30.0
    output_cap_bytes: int = 16384  # per result; a truncation marker line comes on top

    def __post_init__(self) -> None:
        unknown = sorted(set(self.allowed) - set(OPTIONAL_TOOLS))
        if unknown:
            raise ValueError(
                f"unknown tool {', '.join(map(repr, unknown))} in --allow-tools; "
                f"valid: {', '.join(OPTIONAL_TOOLS)}"
            )
        root = Path(self.root).resolve()
        if not root.is_dir():
            raise ValueError(f"working directory {str(self.root)!r} is not a directory")
        if self.shell_timeout_s <= 0:
            raise ValueError(f"shell timeout must be positive, got {self.shell_timeout_s}")
        if self.output_cap_bytes <= 0:
            raise ValueError(f"tool output cap must be positive, got {self.output_cap_bytes}")
        object.__setattr__(self, "allowed", frozenset(self.allowed))
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "extra_paths", tuple((root / p).resolve() for p in self.extra_paths))

    @classmethod
    def parse(
        cls, allow_tools: str, *, root: Path | None = None, extra_paths: Iterable[Path | str] = ()
    ) -> ToolPermissions:
        """Permissions from an ``--allow-tools`` value such as ``"shell,write"`` ("" allows none)."""
        names = frozenset(name.strip().lower() for name in allow_tools.split(",") if name.strip())
        return cls(
            allowed=names,
            root=Path.cwd() if root is None else root,
            extra_paths=tuple(Path(p) for p in extra_paths),
        )

    def confine(self, requested: str) -> Path:
        """The resolved path for ``requested``, or :class:`ToolRefused` if it escapes."""
        try:
            resolved = (self.root / requested).resolve()  # follows symlinks; absolute wins the join
        except (OSError, ValueError) as e:  # a NUL byte, a symlink loop
            raise ToolError(f"cannot use path {requested!r}: {e}") from None
        if resolved.is_relative_to(self.root) or any(resolved.is_relative_to(p) for p in self.extra_paths):
            return resolved
        raise ToolRefused(f"{requested!r} is outside the working directory and the paths the user named")


def _spec(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


_SPECS: dict[str, dict[str, Any]] = {
    "recall": _spec(
        "recall",
        "Search this session's earlier messages, including ones no longer in your context.",
        {
            "query": {"type": "string", "description": "Words to search for."},
            "limit": {
                "type": "integer",
                "description": f"Most hits to return (default 5, max {MAX_RECALL_HITS}).",
            },
        },
        ["query"],
    ),
    "read_file": _spec(
        "read_file",
        "Read a text file in the working directory.",
        {
            "path": {"type": "string", "description": "File path, relative to the working directory."},
            "offset": {"type": "integer", "description": "Lines to skip from the start (default 0)."},
            "limit": {"type": "integer", "description": "Most lines to return (default: all that fit)."},
        },
        ["path"],
    ),
    "list_dir": _spec(
        "list_dir",
        "List a directory's entries; directories end with '/'.",
        {"path": {"type": "string", "description": "Directory path (default: the working directory)."}},
        [],
    ),
    "shell": _spec(
        "shell",
        "Run a shell command in the working directory; returns its output and exit code.",
        {"command": {"type": "string", "description": "The command line, run with /bin/sh -c."}},
        ["command"],
    ),
    "write_file": _spec(
        "write_file",
        "Write a text file in the working directory, replacing it if it exists.",
        {
            "path": {"type": "string", "description": "File path, relative to the working directory."},
            "content": {"type": "string", "description": "The whole new content of the file."},
        },
        ["path", "content"],
    ),
}

# The optional tools and the --allow-tools name that enables each.
_PERMISSION_FOR = {"shell": "shell", "write_file": "write"}


class ToolRegistry:
    """The tools offered under one set of permissions, and the one way to run them."""

    def __init__(self, permissions: ToolPermissions, recall: RecallFn | None = None) -> None:
        self.permissions = permissions
        self._recall = recall
        self._handlers: dict[str, Callable[[dict[str, Any]], ToolResult]] = {
            "recall": self._run_recall,
            "read_file": self._run_read_file,
            "list_dir": self._run_list_dir,
            "shell": self._run_shell,
            "write_file": self._run_write_file,
        }

    def names(self) -> list[str]:
        """The tools available under these permissions, in a fixed order."""
        return [name for name in _SPECS if self._offers(name)]

    def specs(self) -> list[dict[str, Any]]:
        """JSON-schema function specs of the available tools, for the system prompt."""
        return [copy.deepcopy(_SPECS[name]) for name in self.names()]

    def run(self, call: ToolCall) -> ToolResult:
        """Run ``call``; problems come back as a failed result, never as an exception."""
        started = time.perf_counter()
        try:
            result = self._dispatch(call)
        except ToolRefused as e:
            result = ToolResult(ok=False, content=f"refused: {e}", refused=True)
        except ToolError as e:
            result = ToolResult(ok=False, content=f"error: {e}")
        result.duration_ms = (time.perf_counter() - started) * 1000
        return result

    def _offers(self, name: str) -> bool:
        if name == "recall":
            return self._recall is not None
        permission = _PERMISSION_FOR.get(name)
        return permission is None or permission in self.permissions.allowed

    def _dispatch(self, call: ToolCall) -> ToolResult:
        if call.name not in _SPECS:
            raise ToolError(f"unknown tool {call.name!r}; available: {', '.join(self.names())}")
        if call.name in _PERMISSION_FOR and not self._offers(call.name):
            permission = _PERMISSION_FOR[call.name]
            raise ToolRefused(
                f"{call.name} is not allowed in this session "
                f"(the user can allow it with --allow-tools {permission})"
            )
        if not self._offers(call.name):
            raise ToolError(f"{call.name} is not available in this session")
        arguments = _check_arguments(call.name, call.arguments)
        try:
            return self._handlers[call.name](arguments)
        except OSError as e:  # a missing file, a permission denied by the OS
            where = f" ({arguments['path']!r})" if "path" in arguments else ""
            raise ToolError(f"{call.name} failed: {e.strerror or e}{where}") from None

    def _run_recall(self, args: dict[str, Any]) -> ToolResult:
        assert self._recall is not None  # _dispatch offers recall only when it was given
        query = args["query"].strip()
        if not query:
            raise ToolError("recall needs a non-empty query")
        limit = min(args.get("limit", 5), MAX_RECALL_HITS)
        if limit < 1:
            raise ToolError(f"recall limit must be at least 1, got {limit}")
        try:
            hits = self._recall(query, limit)
        except ValueError as e:
            raise ToolError(f"recall could not search for {query!r}: {e}") from None
        if not hits:
            return ToolResult(ok=True, content=f"no earlier messages match {query!r}")
        text = "\n\n".join(
            f"[turn {hit['turn']}, {hit['role']}, message {hit['message_id']}]\n{hit['content']}"
            for hit in hits
        )
        shown, cut = _cap(text, self.permissions.output_cap_bytes)
        marker = f"\n[truncated: {cut} more bytes of hits not shown]" if cut else ""
        return ToolResult(ok=True, content=shown + marker, truncated=bool(cut))

    def _run_read_file(self, args: dict[str, Any]) -> ToolResult:
        path = self.permissions.confine(args["path"])
        offset, limit = args.get("offset", 0), args.get("limit")
        if offset < 0 or (limit is not None and limit < 1):
            raise ToolError("read_file needs offset >= 0 and limit >= 1")
        if path.is_dir():
            raise ToolError(f"{args['path']!r} is a directory; use list_dir")
        cap = self.permissions.output_cap_bytes
        lines: list[str] = []
        num_bytes = 0
        num_lines = 0  # lines past the offset that were read, shown or not
        truncated = False
        with path.open("rb") as f:
            # Sniff first, so a binary file without newlines is not read whole as one "line".
            if b"\0" in f.read(BINARY_SNIFF_BYTES):
                raise _binary_file(args["path"])
            f.seek(0)
            for i, raw in enumerate(f):
                if b"\0" in raw:
                    raise _binary_file(args["path"])
                if i < offset:
                    continue
                if limit is not None and num_lines == limit:
                    break
                num_lines += 1
                if num_bytes + len(raw) > cap:
                    truncated = True
                    if not lines:  # one line longer than the cap: show its head
                        lines.append(raw[:cap].decode("utf-8", errors="ignore"))
                    break
                lines.append(raw.decode("utf-8", errors="replace"))
                num_bytes += len(raw)
        content = "".join(lines)
        if truncated:
            where = f"line {offset + 1} alone is longer; " if num_bytes == 0 else ""
            content = content.rstrip("\n") + (
                f"\n[truncated at {cap} bytes of {path.stat().st_size} in the file; "
                f"{where}read on with offset={offset + len(lines)}]"
            )
        elif not content:
            content = f"[{args['path']!r} has no lines past offset {offset}]"
        return ToolResult(ok=True, content=content, truncated=truncated)

    def _run_list_dir(self, args: dict[str, Any]) -> ToolResult:
        path = self.permissions.confine(args.get("path", "."))
        if not path.is_dir():
            raise ToolError(f"{args.get('path', '.')!r} is not a directory")
        entries = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in path.iterdir())
        if not entries:
            return ToolResult(ok=True, content="[empty directory]")
        shown: list[str] = []
        num_bytes = 0
        for name in entries:  # whole names only, up to the cap
            num_bytes += len(name.encode("utf-8")) + 1
            if num_bytes > self.permissions.output_cap_bytes:
                break
            shown.append(name)
        content = "\n".join(shown)
        num_cut = len(entries) - len(shown)
        if num_cut:
            content += f"\n[truncated: {num_cut} more of {len(entries)} entries not shown]"
        return ToolResult(ok=True, content=content.lstrip("\n"), truncated=bool(num_cut))

    def _run_shell(self, args: dict[str, Any]) -> ToolResult:
        outcome = run_shell(
            args["command"],
            cwd=self.permissions.root,
            timeout_s=self.permissions.shell_timeout_s,
            cap_bytes=self.permissions.output_cap_bytes,
        )
        parts = [outcome.output.decode("utf-8", errors="replace")]
        if outcome.num_bytes_cut:
            parts.append(f"[truncated: {outcome.num_bytes_cut} more bytes of output not shown]")
        if outcome.timed_out:
            parts.append(f"[timed out after {self.permissions.shell_timeout_s:g} s; the command was killed]")
        else:
            parts.append(f"[exit code {outcome.returncode}]")
        content = "\n".join(part.rstrip("\n") for part in parts if part)
        ok = not outcome.timed_out and outcome.returncode == 0
        return ToolResult(ok=ok, content=content, truncated=bool(outcome.num_bytes_cut))

    def _run_write_file(self, args: dict[str, Any]) -> ToolResult:
        path = self.permissions.confine(args["path"])
        if path.is_dir():
            raise ToolError(f"{args['path']!r} is a directory")
        if not path.parent.is_dir():
            if not path.parent.is_relative_to(self.permissions.root):
                raise ToolError(f"the directory of {args['path']!r} does not exist")
            path.parent.mkdir(parents=True, exist_ok=True)
        data = args["content"].encode("utf-8")
        write_atomically(path, data)
        return ToolResult(ok=True, content=f"wrote {len(data)} bytes to {args['path']}")


def _check_arguments(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` checked against the tool's schema; integers given as digit strings pass."""
    parameters = _SPECS[name]["function"]["parameters"]
    properties: dict[str, dict[str, Any]] = parameters["properties"]
    unexpected = sorted(set(arguments) - set(properties))
    if unexpected:
        expected = ", ".join(properties) or "none"
        raise ToolError(f"{name} got unexpected argument(s) {', '.join(unexpected)}; expected: {expected}")
    missing = [key for key in parameters["required"] if key not in arguments]
    if missing:
        raise ToolError(f"{name} is missing required argument(s): {', '.join(missing)}")
    checked: dict[str, Any] = {}
    for key, value in arguments.items():
        kind = properties[key]["type"]
        if kind == "integer" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if kind == "integer" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ToolError(f"{name} argument {key} must be an integer, got {json.dumps(value)}")
        if kind == "string" and not isinstance(value, str):
            raise ToolError(f"{name} argument {key} must be a string, got {json.dumps(value)}")
        checked[key] = value
    return checked


def _binary_file(requested: str) -> ToolError:
    return ToolError(f"{requested!r} is a binary file (it contains NUL bytes); read_file reads text only")


def _cap(text: str, cap_bytes: int) -> tuple[str, int]:
    """``text`` cut to at most ``cap_bytes`` of UTF-8, and how many bytes were cut."""
    data = text.encode("utf-8")
    if len(data) <= cap_bytes:
        return text, 0
    return data[:cap_bytes].decode("utf-8", errors="ignore"), len(data) - cap_bytes
