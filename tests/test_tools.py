"""The tool registry: permissions, path confinement, caps, the shell's timeout, atomic writes."""

import os
import time
from pathlib import Path
from typing import Any

import pytest

from agent.tools import process_io
from agent.tools.calls import ToolCall
from agent.tools.process_io import write_atomically
from agent.tools.registry import ToolPermissions, ToolRegistry
from agent.tools.result import ToolResult


def call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments, raw="")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("one\ntwo\nthree\n")
    (work / "src").mkdir()
    (work / "src" / "main.py").write_text("print('hi')\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    return work


def registry(root: Path, allow: str = "", **kwargs: Any) -> ToolRegistry:
    permissions = ToolPermissions.parse(allow, root=root, extra_paths=kwargs.pop("extra_paths", ()))
    if kwargs:
        permissions = ToolPermissions(
            allowed=permissions.allowed, root=root, extra_paths=permissions.extra_paths, **kwargs
        )
    return ToolRegistry(permissions)


# --- permissions -------------------------------------------------------------------------------


def test_parse_allow_tools() -> None:
    assert ToolPermissions.parse("").allowed == frozenset()
    assert ToolPermissions.parse(" shell , write ").allowed == {"shell", "write"}
    assert ToolPermissions.parse("write").allowed == {"write"}
    assert ToolPermissions.parse("").root == Path.cwd().resolve()


def test_parse_rejects_unknown_names_listing_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"^unknown tool 'rm' in --allow-tools; valid: shell, write$"):
        ToolPermissions.parse("shell,rm")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"shell_timeout_s": 0}, "shell timeout"),
        ({"output_cap_bytes": 0}, "output cap"),
        ({"root": Path("/no/such/dir")}, "not a directory"),
    ],
)
def test_permissions_validate(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ToolPermissions(**kwargs)


def test_specs_offer_optional_tools_only_when_allowed(root: Path) -> None:
    def names(reg: ToolRegistry) -> list[str]:
        return [spec["function"]["name"] for spec in reg.specs()]

    assert names(registry(root)) == ["read_file", "list_dir"]
    assert names(registry(root, "shell,write")) == ["read_file", "list_dir", "shell", "write_file"]
    with_recall = ToolRegistry(ToolPermissions(root=root), recall=lambda q, n: [])
    assert names(with_recall) == ["recall", "read_file", "list_dir"]
    spec = registry(root).specs()[0]
    assert spec["type"] == "function"
    assert spec["function"]["parameters"]["required"] == ["path"]


def test_shell_refused_without_allow_and_never_run(root: Path) -> None:
    result = registry(root, "write").run(call("shell", command="touch ran-marker"))
    assert not result.ok and result.refused
    assert result.content == (
        "refused: shell is not allowed in this session (the user can allow it with --allow-tools shell)"
    )
    assert not (root / "ran-marker").exists()


def test_write_refused_without_allow_and_nothing_written(root: Path) -> None:
    result = registry(root, "shell").run(call("write_file", path="new.txt", content="x"))
    assert not result.ok and result.refused
    assert "--allow-tools write" in result.content
    assert not (root / "new.txt").exists()


def test_shell_runs_when_allowed(root: Path) -> None:
    result = registry(root, "shell").run(call("shell", command="touch ran-marker; echo out; echo err >&2"))
    assert result.ok and not result.refused
    assert (root / "ran-marker").exists()  # it ran in the working directory
    assert result.content == "out\nerr\n[exit code 0]"
    assert result.duration_ms > 0


def test_shell_reports_a_failing_exit_code(root: Path) -> None:
    result = registry(root, "shell").run(call("shell", command="echo nope; exit 3"))
    assert not result.ok and not result.refused
    assert result.content == "nope\n[exit code 3]"


def test_shell_stdin_is_closed(root: Path) -> None:
    result = registry(root, "shell").run(call("shell", command="cat; echo end"))
    assert result.ok and result.content == "end\n[exit code 0]"


def test_shell_timeout_kills_the_whole_process_group(root: Path) -> None:
    """A background child holding the output pipe outlives a kill of the shell alone."""
    reg = registry(root, "shell", shell_timeout_s=0.5)
    started = time.monotonic()
    result = reg.run(call("shell", command="sleep 30 & echo $!; sleep 30"))
    assert time.monotonic() - started < 5
    assert not result.ok and not result.refused
    pid, marker = result.content.splitlines()
    assert marker == "[timed out after 0.5 s; the command was killed]"
    assert _is_gone(int(pid))


def _is_gone(pid: int, wait_s: float = 2.0) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped by its new parent counts as gone)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_shell_output_is_capped_while_read(root: Path) -> None:
    reg = registry(root, "shell", output_cap_bytes=100)
    result = reg.run(call("shell", command="head -c 1000000 /dev/zero | tr '\\0' x"))
    assert result.ok and result.truncated
    lines = result.content.splitlines()
    assert lines == ["x" * 100, "[truncated: 999900 more bytes of output not shown]", "[exit code 0]"]


# --- arguments and unknown tools ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool_call", "fragment"),
    [
        (call("delete_everything"), "unknown tool 'delete_everything'; available: read_file, list_dir"),
        (call("recall", query="x"), "recall is not available"),
        (call("read_file"), "missing required argument(s): path"),
        (call("read_file", path=3), "argument path must be a string"),
        (call("read_file", path="notes.txt", limit="lots"), "argument limit must be an integer"),
        (call("read_file", path="notes.txt", bogus=1), "unexpected argument(s) bogus"),
        (
            call("read_file", path="missing.txt"),
            "read_file failed: No such file or directory ('missing.txt')",
        ),
        (call("read_file", path="src"), "is a directory; use list_dir"),
        (call("list_dir", path="notes.txt"), "is not a directory"),
        (call("read_file", path="a\0b"), "cannot use path"),
    ],
)
def test_tool_level_problems_are_results_not_exceptions(
    root: Path, tool_call: ToolCall, fragment: str
) -> None:
    result = registry(root).run(tool_call)
    assert not result.ok and not result.refused
    assert result.content.startswith("error: ") and fragment in result.content
    assert "\n" not in result.content


def test_integer_arguments_given_as_strings_are_accepted(root: Path) -> None:
    result = registry(root).run(call("read_file", path="notes.txt", offset="1", limit="1"))
    assert result.ok and result.content == "two\n"


# --- confinement --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["../secret.txt", "src/../../secret.txt", "/etc/hostname", "/"])
def test_paths_outside_the_working_directory_are_refused(root: Path, path: str) -> None:
    for tool_call in (call("read_file", path=path), call("list_dir", path=path)):
        result = registry(root).run(tool_call)
        assert not result.ok and result.refused
        assert result.content == (
            f"refused: {path!r} is outside the working directory and the paths the user named"
        )


def test_symlink_escaping_the_working_directory_is_refused(root: Path) -> None:
    (root / "link.txt").symlink_to(root.parent / "secret.txt")
    (root / "linkdir").symlink_to(root.parent)
    reg = registry(root, "write")
    assert reg.run(call("read_file", path="link.txt")).refused
    assert reg.run(call("list_dir", path="linkdir")).refused
    assert reg.run(call("read_file", path="linkdir/secret.txt")).refused
    assert reg.run(call("write_file", path="link.txt", content="pwned")).refused
    assert (root.parent / "secret.txt").read_text() == "outside\n"


def test_symlink_inside_the_working_directory_is_followed(root: Path) -> None:
    (root / "alias.txt").symlink_to(root / "notes.txt")
    assert registry(root).run(call("read_file", path="alias.txt")).content == "one\ntwo\nthree\n"


def test_paths_the_user_named_are_allowed(root: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "deep").mkdir(parents=True)
    (shared / "deep" / "f.txt").write_text("shared\n")
    reg = registry(root, extra_paths=[tmp_path / "secret.txt", shared])
    assert reg.run(call("read_file", path=str(tmp_path / "secret.txt"))).content == "outside\n"
    assert reg.run(call("read_file", path="../secret.txt")).content == "outside\n"
    assert reg.run(call("read_file", path=str(shared / "deep" / "f.txt"))).content == "shared\n"
    assert reg.run(call("list_dir", path=str(shared))).content == "deep/"
    assert reg.run(call("list_dir", path=str(tmp_path))).refused  # the parent of a named path is not


# --- read_file and list_dir ---------------------------------------------------------------------


def test_read_file_offset_and_limit_in_lines(root: Path) -> None:
    reg = registry(root)
    assert reg.run(call("read_file", path="notes.txt")).content == "one\ntwo\nthree\n"
    assert reg.run(call("read_file", path="notes.txt", offset=1)).content == "two\nthree\n"
    assert reg.run(call("read_file", path="notes.txt", offset=1, limit=1)).content == "two\n"
    past = reg.run(call("read_file", path="notes.txt", offset=9))
    assert past.ok and past.content == "['notes.txt' has no lines past offset 9]"


def test_read_file_truncates_whole_lines_and_says_where_to_read_on(root: Path) -> None:
    (root / "big.txt").write_text("".join(f"line {i:03}\n" for i in range(100)))  # 9 bytes each
    result = registry(root, output_cap_bytes=50).run(call("read_file", path="big.txt", offset=10))
    assert result.ok and result.truncated
    *lines, marker = result.content.splitlines()
    assert lines == [f"line {i:03}" for i in range(10, 15)]
    assert marker == "[truncated at 50 bytes of 900 in the file; read on with offset=15]"


def test_read_file_shows_the_head_of_a_line_longer_than_the_cap(root: Path) -> None:
    (root / "wide.txt").write_text("é" * 100 + "\nnext\n")
    result = registry(root, output_cap_bytes=51).run(call("read_file", path="wide.txt"))
    assert result.truncated
    head, marker = result.content.splitlines()
    assert head == "é" * 25  # 51 bytes cut inside a two-byte character: no broken character
    assert "line 1 alone is longer; read on with offset=1" in marker


def test_read_file_refuses_binary_files(root: Path) -> None:
    (root / "blob.bin").write_bytes(b"\x7fELF\x00\x01\x02")
    (root / "late.bin").write_bytes(b"text\n" * 3000 + b"\x00")  # the NUL is past the sniffed head
    for name in ("blob.bin", "late.bin"):
        result = registry(root).run(call("read_file", path=name))
        assert not result.ok
        assert (
            result.content
            == f"error: {name!r} is a binary file (it contains NUL bytes); read_file reads text only"
        )


def test_list_dir_sorts_marks_directories_and_caps(root: Path) -> None:
    (root / "b.txt").write_text("")
    (root / ".hidden").write_text("")
    reg = registry(root)
    assert reg.run(call("list_dir")).content == ".hidden\nb.txt\nnotes.txt\nsrc/"
    assert reg.run(call("list_dir", path="src")).content == "main.py"
    (root / "empty").mkdir()
    assert reg.run(call("list_dir", path="empty")).content == "[empty directory]"
    many = root / "many"
    many.mkdir()
    for i in range(50):
        (many / f"f{i:02}").write_text("")
    capped = registry(root, output_cap_bytes=16).run(call("list_dir", path="many"))
    assert capped.truncated
    assert capped.content.splitlines() == [
        "f00",
        "f01",
        "f02",
        "f03",
        "[truncated: 46 more of 50 entries not shown]",
    ]


# --- write_file ---------------------------------------------------------------------------------


def test_write_file_creates_parents_inside_root_and_replaces(root: Path) -> None:
    reg = registry(root, "write")
    result = reg.run(call("write_file", path="out/deep/new.txt", content="héllo\n"))
    assert result.ok and result.content == "wrote 7 bytes to out/deep/new.txt"
    assert (root / "out" / "deep" / "new.txt").read_text() == "héllo\n"
    (root / "notes.txt").chmod(0o640)
    assert reg.run(call("write_file", path="notes.txt", content="new")).ok
    assert (root / "notes.txt").read_text() == "new"
    assert (root / "notes.txt").stat().st_mode & 0o777 == 0o640  # permission bits survive
    assert sorted(p.name for p in root.iterdir() if p.name.endswith(".tmp")) == []


def test_write_file_does_not_create_directories_outside_root(root: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    reg = registry(root, "write", extra_paths=[shared])
    assert reg.run(call("write_file", path=str(shared / "ok.txt"), content="x")).ok
    result = reg.run(call("write_file", path=str(shared / "new" / "x.txt"), content="x"))
    assert not result.ok and "does not exist" in result.content
    assert not (shared / "new").exists()
    assert reg.run(call("write_file", path="../elsewhere.txt", content="x")).refused
    assert not (tmp_path / "elsewhere.txt").exists()


def test_write_is_atomic_when_the_write_fails(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash mid-write must leave the old file whole and no temporary file behind."""
    target = root / "notes.txt"

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(process_io.os, "fsync", broken_fsync)
    result = registry(root, "write").run(call("write_file", path="notes.txt", content="half"))
    assert (
        not result.ok and result.content == "error: write_file failed: No space left on device ('notes.txt')"
    )
    assert target.read_text() == "one\ntwo\nthree\n"
    assert sorted(os.listdir(root)) == ["notes.txt", "src"]


def test_write_atomically_replaces_via_rename(tmp_path: Path) -> None:
    target = tmp_path / "f.txt"
    target.write_text("old")
    before = target.stat().st_ino
    write_atomically(target, b"new")
    assert target.read_bytes() == b"new"
    assert target.stat().st_ino != before  # a new file renamed over the old, not rewritten in place


# --- recall -------------------------------------------------------------------------------------


def test_recall_calls_the_injected_search_and_formats_hits(root: Path) -> None:
    asked: list[tuple[str, int]] = []

    def search(query: str, limit: int) -> list[dict[str, Any]]:
        asked.append((query, limit))
        return [
            {"message_id": 7, "role": "user", "content": "my cat is Tom", "turn": 2, "score": 1.0},
            {"message_id": 9, "role": "assistant", "content": "Tom the cat", "turn": 3},
        ]

    reg = ToolRegistry(ToolPermissions(root=root), recall=search)
    result = reg.run(call("recall", query=" cat "))
    assert asked == [("cat", 5)]
    assert result.ok
    assert (
        result.content
        == "[turn 2, user, message 7]\nmy cat is Tom\n\n[turn 3, assistant, message 9]\nTom the cat"
    )
    reg.run(call("recall", query="cat", limit=500))
    assert asked[-1] == ("cat", 20)


def test_recall_without_hits_and_with_a_bad_query(root: Path) -> None:
    def search(query: str, limit: int) -> list[dict[str, Any]]:
        if '"' in query:
            raise ValueError("unbalanced quote")
        return []

    reg = ToolRegistry(ToolPermissions(root=root), recall=search)
    assert reg.run(call("recall", query="dogs")).content == "no earlier messages match 'dogs'"
    bad = reg.run(call("recall", query='"dogs'))
    assert not bad.ok and bad.content == "error: recall could not search for '\"dogs': unbalanced quote"
    assert reg.run(call("recall", query="  ")).content == "error: recall needs a non-empty query"


def test_tool_result_defaults() -> None:
    assert ToolResult(ok=True, content="x") == ToolResult(True, "x", False, False, 0.0)
