"""``liubai pull``: fetch and convert a known model (or a .gguf file) once, or tiktoken's encodings."""

import argparse

from agent.errors import EXIT_OK


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
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
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from runtime.backends.tiktoken_pull import TIKTOKEN_PULL_NAME

    if args.model == TIKTOKEN_PULL_NAME:
        from runtime.backends.tiktoken_pull import pull_tiktoken_encodings

        print(pull_tiktoken_encodings())
        return EXIT_OK
    from runtime.models.loader import resolve_model

    print(resolve_model(args.model, pull=True))
    return EXIT_OK
