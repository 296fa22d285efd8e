"""The command palette's view of the slash commands (Ctrl-P).

The palette only finds and chooses: its provider posts :class:`~tui.messages.CommandChosen` (or
:class:`~tui.messages.PrefillInput` for a command that still needs its argument) to the screen it
was opened on, which carries the command out exactly as if it had been typed.
"""

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from tui.commands import COMMAND_SPECS, SPECS_BY_NAME, CommandError, CommandSpec, SlashCommand, parse_command
from tui.messages import CommandChosen, PrefillInput


class SlashCommandProvider(Provider):
    """The slash commands in Textual's command palette (Ctrl-P).

    Typing a whole command (``pin 3``, ``/budget 2000tok``) offers to run it as typed; a command
    name alone runs it, or, when it needs an argument, puts ``/name `` into the chat input.
    """

    async def discover(self) -> Hits:
        for spec in COMMAND_SPECS:
            yield DiscoveryHit(spec.usage, partial(self._choose, spec), help=spec.help)

    async def search(self, query: str) -> Hits:
        typed = query.strip()
        if " " in typed:
            try:
                command = parse_command(typed if typed.startswith("/") else f"/{typed}")
            except CommandError:
                pass  # not a whole command yet: fall through to matching the names
            else:
                spec = SPECS_BY_NAME[command.name]
                yield Hit(1.0, command.text, partial(self._run, command), help=spec.help)
                return
        matcher = self.matcher(typed.removeprefix("/"))
        for spec in COMMAND_SPECS:
            score = matcher.match(spec.usage)
            if score > 0:
                yield Hit(score, matcher.highlight(spec.usage), partial(self._choose, spec), help=spec.help)

    def _choose(self, spec: CommandSpec) -> None:
        if spec.runs_alone:
            self._run(SlashCommand(spec.name))
        else:
            self.screen.post_message(PrefillInput(f"/{spec.name} "))

    def _run(self, command: SlashCommand) -> None:
        self.screen.post_message(CommandChosen(command))
