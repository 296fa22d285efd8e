"""The ``liubai`` command line: argument wiring, and the one edge where errors become messages.

Each subcommand is an ``_add_<name>`` function declaring its arguments and a ``_cmd_<name>``
handler that builds an options object and calls into the module that does the work, so this
file stays a table of contents. Every runtime import happens inside a function, never at module
import, so that Ctrl-C while torch is still loading is handled like any other interrupt.

Exit codes: 0 success, 1 a runtime failure (``EngineError``, bad input found while running),
2 a usage error, 130 interrupted. A user error is one ``liubai: error: ...`` line on stderr,
never a traceback; set ``LIUBAI_DEBUG=1`` to get the traceback anyway.
"""

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.config import AgentConfig

Handler = Callable[[argparse.Namespace], int]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(ValueError):
    """Arguments that parse but make no sense together; exits 2 like argparse's own errors."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="liubai",
        description="A terminal agent runtime for local language models.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_chat(commands)
    _add_pull(commands)
    _add_run(commands)
    from agent.cli import plan as plan_command
    from agent.cli import serve as serve_command
    from agent.logs import report as logs

    serve_command.add_parser(commands)
    logs.add_parser(commands)
    plan_command.add_parser(commands)
    return parser


def _add_pull(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from runtime.models.registry import DEFAULT_MODEL, known_names

    p = commands.add_parser(
        "pull",
        help="download and convert a model once",
        description=f"Fetch a known model ({', '.join(known_names())}) or convert a .gguf file "
        "into the user cache, then print its directory. `liubai pull tiktoken` fetches tiktoken's "
        "encodings (cl100k_base, p50k_base, o200k_base) for counting tokens of OpenAI-family models offline.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        metavar="MODEL",
        help=f"short name or .gguf file (default: {DEFAULT_MODEL})",
    )
    p.set_defaults(handler=_cmd_pull)


def add_agent_options(p: argparse.ArgumentParser) -> None:
    """The options ``run`` and ``chat`` share: model and backend, KV, sampling, tools, prices, db."""
    from agent.config import KV_DTYPES
    from runtime.models.registry import DEFAULT_MODEL

    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help=f"short name, model directory or .gguf file; with --backend openai the served name "
        f"(default: {DEFAULT_MODEL})",
    )
    model.add_argument("--system", "-s", default=None, help="system message")
    model.add_argument(
        "--backend",
        choices=("local", "openai"),
        default="local",
        help="local engine or an OpenAI-compatible server",
    )
    model.add_argument("--base-url", default=None, help="the server's URL with --backend openai")
    model.add_argument(
        "--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key"
    )
    model.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="model dtype; auto is bfloat16 on CUDA, float32 on CPU",
    )

    kv = p.add_argument_group("KV memory")
    kv.add_argument(
        "--kv-budget",
        metavar="SIZE",
        default=None,
        help="the conversation's KV budget, e.g. 24MiB or 4096tok (default, and most: the model's context)",
    )
    kv.add_argument(
        "--kv-pool",
        metavar="SIZE",
        default=None,
        help="KV cache pool size, e.g. 256MiB (default: chosen by the engine)",
    )
    kv.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="KV cache storage for keys and values: auto (the model dtype), int8, fp8 or int4",
    )
    kv.add_argument("--k-dtype", choices=KV_DTYPES, default=None, help="KV storage for keys alone")
    kv.add_argument("--v-dtype", choices=KV_DTYPES, default=None, help="KV storage for values alone")
    kv.add_argument(
        "--no-recall", action="store_true", help="do not bring evicted turns back into the prompt"
    )
    kv.add_argument(
        "--summary-tokens",
        type=int,
        default=192,
        metavar="N",
        help="most tokens a compaction's summary may take (default: 192)",
    )

    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply (default: 256)")
    sampling.add_argument("--temperature", "-t", type=float, default=0.0, help="0 is greedy (default: 0)")
    sampling.add_argument(
        "--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 disables"
    )
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 disables")
    sampling.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")

    tools = p.add_argument_group("tools")
    tools.add_argument("--no-tools", action="store_true", help="offer the model no tools at all")
    tools.add_argument(
        "--allow-tools",
        default="",
        metavar="LIST",
        help="also allow these optional tools: shell, write (comma-separated; default: none)",
    )
    tools.add_argument(
        "--allow-path",
        action="append",
        default=[],
        metavar="PATH",
        help="a path outside the working directory the file tools may read",
    )
    tools.add_argument("--max-tool-rounds", type=int, default=4, help="tool rounds per turn (default: 4)")

    logs = p.add_argument_group("logs and cost")
    logs.add_argument(
        "--db", default=None, metavar="PATH", help="the SQLite database (default: in the user data dir)"
    )
    logs.add_argument(
        "--price-per-hour", type=float, default=None, metavar="USD", help="machine price, for cost"
    )
    logs.add_argument(
        "--prices",
        default=None,
        metavar="SPEC",
        help="token prices in=..,cached=..,out=.. ($/Mtok) or a preset name",
    )
    logs.add_argument("--price-table", default=None, metavar="FILE", help="a TOML file of per-model prices")


def agent_config(args: argparse.Namespace) -> "AgentConfig":
    from agent.config import AgentConfig

    try:
        return AgentConfig(
            model=args.model,
            backend=args.backend,
            base_url=args.base_url,
            api_key_env=args.api_key_env,
            system=args.system,
            kv_budget=args.kv_budget,
            kv_pool=args.kv_pool,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            k_dtype=args.k_dtype,
            v_dtype=args.v_dtype,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            db=args.db,
            tools=not args.no_tools,
            allow_tools=args.allow_tools,
            extra_paths=tuple(args.allow_path),
            max_tool_rounds=args.max_tool_rounds,
            recall=not args.no_recall,
            summary_tokens=args.summary_tokens,
            price_per_hour=args.price_per_hour,
            prices=args.prices,
            price_table=args.price_table,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _add_chat(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = commands.add_parser(
        "chat",
        help="the interactive chat (the default command)",
        description="Chat in the terminal, with the KV budget, turn map and latency live beside the reply.",
    )
    p.add_argument("--session", default=None, metavar="ID", help="resume a stored session")
    add_agent_options(p)
    p.set_defaults(handler=_cmd_chat)


def _cmd_chat(args: argparse.Namespace) -> int:
    config = agent_config(args)
    from tui.app import run_chat  # the one place agent/ reaches into tui/

    return run_chat(config, args.session)


def _add_run(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
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
    p.set_defaults(handler=_cmd_run)


def _cmd_pull(args: argparse.Namespace) -> int:
    from runtime.backends.tiktoken_pull import TIKTOKEN_PULL_NAME

    if args.model == TIKTOKEN_PULL_NAME:
        from runtime.backends.tiktoken_pull import pull_tiktoken_encodings

        print(pull_tiktoken_encodings())
        return EXIT_OK
    from runtime.models.loader import resolve_model

    print(resolve_model(args.model, pull=True))
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from agent.headless.runner import HeadlessRun, run_headless
    from agent.headless.script import ScriptError

    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    config = agent_config(args)
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
    # Importing any runtime module imports the runtime package, and with it torch.
    from memory.errors import MemoryLayerError
    from runtime.errors import EngineError

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
    except (EngineError, MemoryLayerError, ValueError) as exc:
        return _fail(exc, EXIT_FAILURE, args)


def _fail(exc: Exception, code: int, args: argparse.Namespace | None) -> int:
    if os.environ.get("LIUBAI_DEBUG"):
        raise exc
    message = " ".join(str(exc).split()) or type(exc).__name__  # exactly one line
    if args is not None and (getattr(args, "json", False) or getattr(args, "jsonl", False)):
        print(json.dumps({"type": "result", "is_error": True, "error": message, "exit_code": code}))
    print(f"liubai: error: {message}", file=sys.stderr)
    return code


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liubai")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
