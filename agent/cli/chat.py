"""``liubai chat``: the interactive chat (also what ``liubai`` alone opens)."""

import argparse

from agent.cli.options import add_agent_options, agent_config


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = commands.add_parser(
        "chat",
        help="the interactive chat (the default command)",
        description="Chat in the terminal, with the KV budget, turn map and latency live beside the reply.",
    )
    p.add_argument("--session", default=None, metavar="ID", help="resume a stored session")
    add_agent_options(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = agent_config(args)
    from tui.app import run_chat  # the one place agent/ reaches into tui/

    return run_chat(config, args.session)
