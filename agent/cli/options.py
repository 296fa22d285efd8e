"""The options ``liubai run`` and ``liubai chat`` share, and the :class:`AgentConfig` they make."""

import argparse
from typing import TYPE_CHECKING, Any

from agent.errors import UsageError

if TYPE_CHECKING:
    from agent.config import AgentConfig


def add_agent_options(p: argparse.ArgumentParser) -> None:
    """The options ``run`` and ``chat`` share: model and backend, KV, sampling, tools, prices, db."""
    from agent.config import KV_DTYPES, WEIGHT_FORMATS
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
        help="model dtype; auto is bfloat16 on CUDA and follows --weights on CPU",
    )
    model.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default="auto",
        help="weight format (CPU, Llama family): float32, bfloat16, int8 (per channel) or int4 "
        "(group 32), both with bfloat16 activations; auto: the fastest measured on this CPU within "
        "KLD 1e-3 of float32 (timed once per model), or --dtype's float weights if it is named",
    )
    model.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="decode steps through graphs compiled by inductor (CPU, Llama family, full-precision KV): "
        "faster at batch 1, the first compile ~40 s per batch size and cached on disk (default: off)",
    )
    add_speculation_options(p.add_argument_group("speculative decoding"))

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
    add_kv_disk_option(kv)
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
    tools.add_argument(
        "--tools",
        choices=("auto", "on", "off"),
        default="auto",
        help="offer the model its tools: auto (only to models that call tools, and remote backends), "
        "on or off (default: auto)",
    )
    tools.add_argument(
        "--no-tools", dest="tools", action="store_const", const="off", help="the same as --tools off"
    )
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


def add_kv_disk_option(group: "argparse._ArgumentGroup | argparse.ArgumentParser") -> None:
    from agent.config import DEFAULT_KV_DISK

    group.add_argument(
        "--kv-disk",
        metavar="SIZE",
        default=DEFAULT_KV_DISK,
        help="disk tier of the prefix cache, so new processes and resumed sessions start warm, e.g. "
        f"4GiB; 0 turns it off (default: {DEFAULT_KV_DISK}; see `liubai kv`)",
    )


def add_speculation_options(group: "argparse._ArgumentGroup | argparse.ArgumentParser") -> None:
    """``--speculate``, ``--draft-model``, ``--num-draft-tokens`` and ``--draft-weights``: the
    engine's default for requests (runtime/speculation/), shared by ``run``, ``chat`` and ``serve``."""
    from agent.config import (
        DEFAULT_DRAFT_WEIGHTS,
        DEFAULT_NUM_DRAFT_TOKENS,
        DEFAULT_SPECULATE,
        MAX_NUM_DRAFT_TOKENS,
        SPECULATE_MODES,
        WEIGHT_FORMATS,
    )

    group.add_argument(
        "--speculate",
        choices=SPECULATE_MODES,
        default=None,
        help="speculative decoding: guesses verified in the same step, the same tokens sooner: "
        "ngram (prompt lookup), draft (a draft model), off, or auto: ngram with float32, bfloat16 or "
        f"int4 weights, where bench.spec measured it, off otherwise (default: {DEFAULT_SPECULATE}; draft "
        "when --draft-model is given)",
    )
    group.add_argument(
        "--draft-model",
        metavar="PATH_OR_NAME",
        default=None,
        help="the draft model (short name, directory or .gguf) sharing the model's tokenizer; "
        "implies --speculate draft (default: the model itself in --draft-weights)",
    )
    group.add_argument(
        "--num-draft-tokens",
        type=int,
        default=DEFAULT_NUM_DRAFT_TOKENS,
        metavar="N",
        help=f"most tokens guessed per step, 1 to {MAX_NUM_DRAFT_TOKENS} "
        f"(default: {DEFAULT_NUM_DRAFT_TOKENS})",
    )
    group.add_argument(
        "--draft-weights",
        choices=WEIGHT_FORMATS,
        default=DEFAULT_DRAFT_WEIGHTS,
        help=f"the draft model's weight format (default: {DEFAULT_DRAFT_WEIGHTS})",
    )


def speculation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's speculation options from the parsed flags, checked; a ``UsageError`` names the
    flag that is wrong."""
    from agent.config import check_speculation

    try:
        speculate = check_speculation(
            args.speculate, args.num_draft_tokens, args.draft_model, args.draft_weights
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return {
        "speculate": speculate,
        "num_draft_tokens": args.num_draft_tokens,
        "draft_model": args.draft_model,
        "draft_weights": args.draft_weights,
    }


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
            kv_disk=args.kv_disk,
            dtype=args.dtype,
            weights=args.weights,
            compile=args.compile,
            speculate=args.speculate,
            num_draft_tokens=args.num_draft_tokens,
            draft_model=args.draft_model,
            draft_weights=args.draft_weights,
            kv_dtype=args.kv_dtype,
            k_dtype=args.k_dtype,
            v_dtype=args.v_dtype,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            db=args.db,
            tools=args.tools,
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
