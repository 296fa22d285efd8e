"""``liubai run``: answer one prompt, or run script files of turns, headless."""

import argparse
import sys

from agent.cli.options import add_agent_options, agent_config
from agent.errors import UsageError


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = commands.add_parser(
        "run",
        help="answer a prompt or run scripts, headless",
        description="Answer one prompt (the reply streams to stdout, notices go to stderr), or run "
        "script files of turns and commands. Exit codes: 0 success, 1 error, 2 usage, 130 interrupted.",
    )
    p.add_argument("prompt", nargs="?", metavar="PROMPT", help="the user message; '-' reads it from stdin")
    p.add_argument(
        "--script",
        action="append",
        default=[],
        metavar="FILE",
        help="a JSONL or TOML script of turns (repeatable)",
    )
    p.add_argument(
        "-j", "--jobs", type=int, default=1, help="run this many scripts at once through one engine"
    )
    p.add_argument("--session", default=None, metavar="ID", help="resume a stored session")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON result object per session")
    out.add_argument(
        "--jsonl", action="store_true", help="print the event stream as JSON lines, then the result"
    )
    add_agent_options(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = agent_config(args)  # checked before the runner's imports (torch, 2 s) are paid
    from agent.headless.runner import HeadlessRun, run_headless
    from agent.headless.script import ScriptError

    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        run = HeadlessRun(
            prompt=prompt,
            scripts=args.script,
            session_id=args.session,
            output="json" if args.json else "jsonl" if args.jsonl else "text",
            jobs=args.jobs,
        )
        return run_headless(config, run)
    except ScriptError as exc:
        raise UsageError(str(exc)) from exc
    except ValueError as exc:
        if type(exc) is ValueError:  # the run's own argument checks, not a runtime failure
            raise UsageError(str(exc)) from exc
        raise
