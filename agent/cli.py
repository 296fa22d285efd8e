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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_pull(commands)
    _add_run(commands)
    from agent import plan_command

    plan_command.add_parser(commands)
    return parser


def _add_pull(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from runtime.model_registry import DEFAULT_MODEL, known_names

    p = commands.add_parser(
        "pull",
        help="download and convert a model once",
        description=f"Fetch a known model ({', '.join(known_names())}) or convert a .gguf file "
        "into the user cache, then print its directory.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        metavar="MODEL",
        help=f"short name or .gguf file (default: {DEFAULT_MODEL})",
    )
    p.set_defaults(handler=_cmd_pull)


def _add_run(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from runtime.model_registry import DEFAULT_MODEL

    p = commands.add_parser(
        "run",
        help="answer one prompt and exit",
        description="Answer one prompt: the reply streams to stdout, a timing line goes to stderr.",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the user message; '-' reads it from stdin")
    p.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help=f"short name, model directory or .gguf file (default: {DEFAULT_MODEL})",
    )
    p.add_argument("--system", "-s", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 disables")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 disables")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument(
        "--kv-pool",
        metavar="SIZE",
        default=None,
        help="KV cache pool size, e.g. 256MiB (default: chosen by the engine)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="model dtype; auto is bfloat16 on CUDA, float32 on CPU",
    )
    from agent.oneshot import KV_DTYPES

    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="KV cache storage for keys and values: auto (the model dtype), int8, fp8 or int4",
    )
    p.add_argument("--k-dtype", choices=KV_DTYPES, default=None, help="KV storage for keys alone")
    p.add_argument("--v-dtype", choices=KV_DTYPES, default=None, help="KV storage for values alone")
    p.add_argument("--json", action="store_true", help="print one JSON result object instead of streaming")
    p.set_defaults(handler=_cmd_run)


def _cmd_pull(args: argparse.Namespace) -> int:
    from runtime.model_loader import resolve_model

    print(resolve_model(args.model, pull=True))
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from agent.oneshot import RunOptions, run_oneshot

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        options = RunOptions(
            prompt=prompt,
            model=args.model,
            system=args.system,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            kv_pool=args.kv_pool,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            k_dtype=args.k_dtype,
            v_dtype=args.v_dtype,
            json=args.json,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    run_oneshot(options)
    return EXIT_OK


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
    from runtime.errors import EngineError

    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        handler: Handler = args.handler
        return handler(args)
    except UsageError as exc:
        return _fail(exc, EXIT_USAGE, args)
    except (EngineError, ValueError) as exc:
        return _fail(exc, EXIT_FAILURE, args)


def _fail(exc: Exception, code: int, args: argparse.Namespace | None) -> int:
    if os.environ.get("LIUBAI_DEBUG"):
        raise exc
    message = " ".join(str(exc).split()) or type(exc).__name__  # exactly one line
    if args is not None and getattr(args, "json", False):
        print(json.dumps({"is_error": True, "error": message, "exit_code": code}))
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
