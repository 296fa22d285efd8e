"""``liubai serve``'s arguments, and the run that turns them into a listening server.

``add_parser`` declares the subcommand on the CLI's subparsers; ``run`` checks what can be
checked before any weight is loaded (the API key, the bind address), then loads the engine and
serves until Ctrl-C, which the CLI turns into exit 130. Nothing heavy is imported at module import.
``python -m agent.cli.serve`` runs the same thing without the rest of the CLI. The server
itself is :mod:`runtime.serve.server`.
"""

import argparse
import os
import sys
from collections.abc import Sequence

from agent.cli.options import add_kv_disk_option, add_speculation_options, speculation_options
from agent.config import KV_DTYPES, WEIGHT_FORMATS
from agent.errors import EXIT_FAILURE, EXIT_INTERRUPTED, UsageError, error_line
from runtime.models.registry import DEFAULT_MODEL

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY = "1MiB"


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    p = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve one model behind /v1/chat/completions, /v1/completions, /v1/models and "
        "/metrics (Prometheus). Concurrent clients are batched by one engine.",
    )
    add_arguments(p)
    p.set_defaults(handler=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help=f"short name, model directory or .gguf file (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default: {DEFAULT_HOST}); beyond loopback needs --api-key-env",
    )
    p.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"0 picks a free port (default: {DEFAULT_PORT})"
    )
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        default=None,
        help="environment variable holding the API key clients must send as 'Authorization: Bearer KEY'",
    )
    p.add_argument(
        "--kv-pool", metavar="SIZE", default=None, help="KV cache pool size, e.g. 2GiB (default: engine's)"
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="model dtype; auto is bfloat16 on CUDA and follows --weights on CPU",
    )
    p.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default="auto",
        help="weight format (CPU, Llama family): float32, bfloat16, int8 or int4; "
        "auto: the fastest measured on this CPU within the quality bound",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="decode steps through graphs compiled by inductor (CPU, Llama family, full-precision KV): "
        "faster at batch 1, the first compile ~40 s per batch size and cached on disk (default: off)",
    )
    add_speculation_options(p)
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="KV cache storage for keys and values: auto (the model dtype), int8, fp8 or int4",
    )
    p.add_argument("--k-dtype", choices=KV_DTYPES, default=None, help="KV storage for keys alone")
    p.add_argument("--v-dtype", choices=KV_DTYPES, default=None, help="KV storage for values alone")
    add_kv_disk_option(p)
    p.add_argument(
        "--max-body-bytes",
        metavar="SIZE",
        type=_size,
        default=_size(DEFAULT_MAX_BODY),
        help=f"largest request body accepted; larger gets 413 (default: {DEFAULT_MAX_BODY})",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="most requests batched together (default: 64)"
    )


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted. Raises ``ValueError`` (exit 1 at the CLI) for a missing key, a
    refused bind address or a busy port, before or instead of loading the model."""
    from runtime.layers.weights import check_weight_format
    from runtime.serve.server import OpenAIServer, check_bind

    try:
        check_weight_format(args.weights, args.dtype)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    speculation = speculation_options(args)
    api_key = read_api_key(args.api_key_env)
    check_bind(args.host, api_key)

    from agent.backends import open_engine

    engine, model_name = open_engine(
        args.model,
        kv_pool=args.kv_pool,
        kv_disk=args.kv_disk,
        dtype=args.dtype,
        weights=args.weights,
        compile=args.compile,
        **speculation,
        kv_dtype=args.kv_dtype,
        k_dtype=args.k_dtype,
        v_dtype=args.v_dtype,
        max_num_seqs=args.max_num_seqs,
    )
    try:
        server = OpenAIServer(
            engine,
            model_name,
            host=args.host,
            port=args.port,
            api_key=api_key,
            max_body_bytes=args.max_body_bytes,
        )
    except OSError as exc:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
    print(f"liubai serve: {server.url} (model {server.model_name})", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.shutdown()
    return 0


def read_api_key(var: str | None) -> str | None:
    """The key from environment variable ``var``; a named but unset or empty variable is an error,
    never a silently open server."""
    if var is None:
        return None
    key = os.environ.get(var, "").strip()
    if not key:
        raise ValueError(f"--api-key-env {var}: the environment variable {var} is not set or empty")
    return key


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is between 0 and 65535, got {port}")
    return port


def _size(text: str) -> int:
    from runtime.sizes import parse_size

    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agent.cli.serve [options]``: the serve command without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="liubai serve", description="Serve a model over OpenAI's HTTP API.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    from runtime.errors import EngineError

    try:
        return run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (EngineError, ValueError) as exc:
        print(error_line(exc, prog="liubai serve"), file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
