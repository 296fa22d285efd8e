"""``liubai logs``: list sessions, show one, export requests, fit the slope of latency by context.

The reports themselves are :mod:`agent.logs.report` and :mod:`agent.logs.slope`; this module is
their command line.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from agent.logs.defaults import DEFAULT_THRESHOLD, EXPORT_FORMATS

if TYPE_CHECKING:
    from memory.store import Store


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = commands.add_parser(
        "logs",
        help="sessions, requests and their cost and latency",
        description="List sessions with their tokens, latency and cost; show one session's requests and "
        "compactions; export every request.",
    )
    p.add_argument(
        "--db", default=None, metavar="PATH", help="the SQLite database (default: in the user data dir)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    sub = p.add_subparsers(dest="logs_command", metavar="ACTION")
    show = sub.add_parser("show", help="every request and compaction of a session")
    show.add_argument("session_id", metavar="ID")
    show.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    export = sub.add_parser("export", help="every request as JSON lines or CSV")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="jsonl")
    export.add_argument("--session", default=None, metavar="ID", help="only this session's requests")
    export.add_argument("--output", "-o", default=None, metavar="FILE", help="write here instead of stdout")
    sub.add_parser("path", help="print the database's path")
    _add_slope(sub)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: the store's package imports the runtime, and with it torch.
    from agent.logs.report import export_requests, list_sessions, show_session
    from memory.store import Store, default_db_path

    path = Path(args.db) if args.db else default_db_path()
    action = args.logs_command
    if action == "path":
        print(path)
        return 0
    if not path.exists():
        if getattr(args, "json", False):
            print("[]")
        else:
            print(f"no sessions yet ({path} does not exist)", file=sys.stderr)
        return 0 if action is None else 1
    store = Store(path)
    try:
        if action is None:
            list_sessions(store, args.json, sys.stdout)
        elif action == "show":
            show_session(store, args.session_id, args.json, sys.stdout)
        elif action == "export":
            if args.output:
                with open(args.output, "w", encoding="utf-8", newline="") as f:
                    export_requests(store, args.format, args.session, f)
            else:
                export_requests(store, args.format, args.session, sys.stdout)
        elif action == "slope":
            return _run_slope(store, args, sys.stdout)
    finally:
        store.close()
    return 0


def _tokens(text: str) -> int:
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 tokens, got {value}")
    return value


def _add_slope(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "slope",
        help="how prefill, decode and cost per turn grow with context length",
        description="Fit prefill ms per prefilled token, decode ms per generated token and the compute "
        "seconds (and dollars) per turn against context length, by least squares, for short sessions, "
        "long sessions and all; then chart decode ms/token by context.",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("session_id", nargs="?", metavar="SESSION", help="this session (default: the latest)")
    which.add_argument("--all", action="store_true", help="every stored session")
    p.add_argument(
        "--threshold",
        type=_tokens,
        default=DEFAULT_THRESHOLD,
        metavar="TOKENS",
        help=f"a session is long when its largest context exceeds this (default {DEFAULT_THRESHOLD})",
    )
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")


def _run_slope(store: "Store", args: argparse.Namespace, out: TextIO) -> int:
    from agent.logs.slope import render_slope, slope_report

    if args.all:
        session_ids = [s.id for s in store.list_sessions()]
    elif args.session_id is not None:
        session_ids = [args.session_id]
    else:
        latest = max(store.list_sessions(), key=lambda s: s.updated, default=None)
        session_ids = [latest.id] if latest is not None else []
    report = slope_report(store, session_ids, args.threshold)
    if getattr(args, "json", False):
        out.write(json.dumps(report.to_dict(), ensure_ascii=False) + "\n")
    else:
        out.write(render_slope(report))
    return 0
