"""The ``liubai`` command line: the parser of every command, and the one edge where errors become messages.

Each command is a module of this package with an ``add_parser`` declaring its arguments and a
``run`` handler that builds an options object and calls into the module that does the work
(``chat``, ``run``, ``serve``, ``logs``, ``kv``, ``plan``, ``pull``; ``options`` holds what ``run`` and
``chat`` share). Every runtime import happens inside a function, never at module import, so that
Ctrl-C while torch is still loading is handled like any other interrupt.

Exit codes and the one-line error are :mod:`agent.errors`; set ``LIUBAI_DEBUG=1`` to get the
traceback anyway.
"""

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from agent.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, UsageError, error_line, one_line

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="liubai",
        description="A terminal agent runtime for local language models.",
    )
    # The command modules import here, inside main's Ctrl-C guard, not at module import.
    from agent.cli import chat, kv, logs, plan, pull, run, serve

    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    chat.add_parser(commands)
    pull.add_parser(commands)
    run.add_parser(commands)
    serve.add_parser(commands)
    logs.add_parser(commands)
    kv.add_parser(commands)
    plan.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``liubai`` console script; returns the process exit code."""
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:  # also while torch is still importing, hence this outer layer
        print(file=sys.stderr)  # end the line ^C was echoed on
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; silence the flush at interpreter exit too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE


def _dispatch(argv: Sequence[str] | None) -> int:
    args: argparse.Namespace | None = None
    try:
        parser = build_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
            argv = ["chat", *argv]  # `liubai` alone, or with chat's options, opens the chat
        args = parser.parse_args(argv)
        handler: Handler = args.handler
        return handler(args)
    except UsageError as exc:
        return _fail(exc, EXIT_USAGE, args)
    except Exception as exc:
        if not _told_in_one_line(exc):
            raise
        return _fail(exc, EXIT_FAILURE, args)


def _told_in_one_line(exc: Exception) -> bool:
    """Whether ``exc`` is an error the user is told in one line (the engine's, memory's, a bad value).

    The error classes are imported only here, once something failed: importing any runtime or
    memory module imports its package, and with it torch (2 s), which ``--help``, ``--version``
    and a usage error never need.
    """
    if isinstance(exc, ValueError):
        return True
    from memory.errors import MemoryLayerError
    from runtime.errors import EngineError

    return isinstance(exc, (EngineError, MemoryLayerError))


def _fail(exc: Exception, code: int, args: argparse.Namespace | None) -> int:
    if os.environ.get("LIUBAI_DEBUG"):
        raise exc
    if args is not None and (getattr(args, "json", False) or getattr(args, "jsonl", False)):
        print(json.dumps({"type": "result", "is_error": True, "error": one_line(exc), "exit_code": code}))
    print(error_line(exc), file=sys.stderr)
    return code


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liubai")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
