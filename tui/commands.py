"""The chat's slash commands: what can be typed and how it parses.

A command is parsed into a :class:`SlashCommand` value here and carried out by the chat screen,
so the input line and the palette (Ctrl-P, :mod:`tui.command_palette`) reach exactly the same
code. Plain values and a parser, with no Textual in them: the messages that carry a command
import this module, and nothing here imports them.
"""

from dataclasses import dataclass
from pathlib import Path

EXPORT_SUFFIXES = (".md", ".markdown", ".jsonl")


class CommandError(ValueError):
    """A command line that cannot run as typed; the message says how to type it."""


@dataclass(frozen=True, slots=True)
class CommandSpec:
    name: str
    usage: str
    help: str
    argument: str  # "none", "optional" or "required"

    @property
    def runs_alone(self) -> bool:
        """Whether choosing it from the palette can run it without asking for an argument."""
        return self.argument != "required"


COMMAND_SPECS: tuple[CommandSpec, ...] = (
    CommandSpec(
        "compact", "/compact [focus]", "summarize the completed turns now (focus: what to keep)", "optional"
    ),
    CommandSpec("pin", "/pin N", "keep turn N in the context through compactions", "required"),
    CommandSpec("unpin", "/unpin N", "let turn N be compacted again", "required"),
    CommandSpec("budget", "/budget SIZE", "change the KV budget, e.g. 24MiB or 4096tok", "required"),
    CommandSpec("clear", "/clear", "drop every unpinned turn from the context (all stay stored)", "none"),
    CommandSpec("export", "/export PATH", "write every message to PATH (.md or .jsonl)", "required"),
    CommandSpec("stats", "/stats", "totals for this session and the engine", "none"),
    CommandSpec("help", "/help", "commands and keys", "none"),
)
SPECS_BY_NAME = {spec.name: spec for spec in COMMAND_SPECS}


@dataclass(frozen=True, slots=True)
class SlashCommand:
    name: str
    argument: str | None = None

    @property
    def turn(self) -> int:
        """The turn number of ``/pin N`` and ``/unpin N`` (validated when parsed)."""
        assert self.argument is not None
        return int(self.argument)

    @property
    def text(self) -> str:
        return f"/{self.name}" if self.argument is None else f"/{self.name} {self.argument}"


def is_command(text: str) -> bool:
    return text.lstrip().startswith("/")


def parse_command(text: str) -> SlashCommand:
    """``"/pin 3"`` -> ``SlashCommand("pin", "3")``; raises :class:`CommandError` with the usage."""
    name, _, rest = text.strip().removeprefix("/").partition(" ")
    name = name.lower()
    argument = rest.strip() or None
    spec = SPECS_BY_NAME.get(name)
    if spec is None:
        known = ", ".join(f"/{s.name}" for s in COMMAND_SPECS)
        raise CommandError(f"unknown command /{name} (commands: {known})")
    if spec.argument == "none" and argument is not None:
        raise CommandError(f"/{name} takes no argument")
    if spec.argument == "required" and argument is None:
        raise CommandError(f"usage: {spec.usage} — {spec.help}")
    if name in ("pin", "unpin"):
        assert argument is not None
        if not argument.isdigit() or int(argument) < 1:
            raise CommandError(f"usage: {spec.usage} — N is a turn number (1, 2, ...), got {argument!r}")
    if name == "export":
        assert argument is not None
        if Path(argument).suffix.lower() not in EXPORT_SUFFIXES:
            raise CommandError(f"/export writes Markdown (.md) or JSON lines (.jsonl), not {argument!r}")
    return SlashCommand(name, argument)
