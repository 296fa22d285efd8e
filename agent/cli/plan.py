"""``liubai plan``: the KV-cache capacity planner's arguments and its printed table.

The figures come from :func:`runtime.capacity.plan_kv`; this module turns flags into a
:class:`~runtime.capacity.PlanRequest` and a plan into lines a person reads (or one JSON object).
Runtime modules are imported inside functions so that ``liubai --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.capacity import KVPlan, ModelShape, StorageTerm

_SHAPE_FLAGS = ("layers", "heads", "kv_heads", "head_dim")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from agent.config import KV_DTYPES
    from runtime.capacity import BLOCK_SIZE, DEFAULT_DTYPE, MODEL_DTYPES
    from runtime.models.registry import DEFAULT_MODEL

    p = commands.add_parser(
        "plan",
        help="size the KV cache: bytes per token, per session, sessions per pool",
        description="Compute a model's KV-cache bytes per token, per session and how many sessions a "
        "pool holds (or how large a pool N sessions need), with the engine's own arithmetic. Only the "
        f"model's config is read, never its weights. Sessions take whole {BLOCK_SIZE}-token blocks.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"pulled short name, model directory or .gguf file (default: {DEFAULT_MODEL})",
    )
    shape = p.add_argument_group("a shape instead of a model")
    shape.add_argument("--layers", type=int, metavar="N", help="decoder layers")
    shape.add_argument("--heads", type=int, metavar="N", help="attention heads (default: --kv-heads)")
    shape.add_argument("--kv-heads", type=int, metavar="N", help="key/value heads (default: --heads)")
    shape.add_argument("--head-dim", type=int, metavar="N", help="dimensions per head")
    p.add_argument(
        "--dtype",
        choices=MODEL_DTYPES,
        default=DEFAULT_DTYPE,
        help=f"model dtype, which auto KV storage keeps (default: {DEFAULT_DTYPE}, the engine's on CPU)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="KV storage for keys and values: auto (the model dtype), int8, fp8 or int4",
    )
    p.add_argument("--k-dtype", choices=KV_DTYPES, default=None, help="KV storage for keys alone")
    p.add_argument("--v-dtype", choices=KV_DTYPES, default=None, help="KV storage for values alone")
    p.add_argument(
        "--context",
        "-c",
        metavar="TOKENS",
        default=None,
        help="tokens per session, e.g. 8192 or 8k (k = 1024; default: the model's context length)",
    )
    p.add_argument(
        "--pool", metavar="SIZE", default=None, help="KV pool size, e.g. 24GiB: how many sessions fit"
    )
    p.add_argument(
        "--sessions",
        type=int,
        metavar="N",
        default=None,
        help="concurrent sessions: how large a pool they need",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from agent.errors import UsageError
    from runtime.capacity import PlanRequest, parse_context, plan_kv, read_shape
    from runtime.models.registry import DEFAULT_MODEL
    from runtime.sizes import parse_size

    try:
        request = PlanRequest(
            dtype=args.dtype,
            k_dtype=args.k_dtype or args.kv_dtype,
            v_dtype=args.v_dtype or args.kv_dtype,
            context=None if args.context is None else parse_context(args.context),
            pool_bytes=None if args.pool is None else parse_size(args.pool),
            num_sessions=args.sessions,
        )
        shape = _given_shape(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if shape is None:
        shape = read_shape(args.model or DEFAULT_MODEL)  # ModelError: exit 1
    try:
        plan = plan_kv(shape, request)
    except ValueError as exc:  # e.g. a pool to size without any context length
        raise UsageError(str(exc)) from exc
    print(json.dumps(plan.to_dict()) if args.json else render_plan(plan))
    return 0


def _given_shape(args: argparse.Namespace) -> ModelShape | None:
    from runtime.capacity import ModelShape

    if all(getattr(args, flag) is None for flag in _SHAPE_FLAGS):
        return None
    if args.model is not None:
        raise ValueError("give a model or a shape (--layers, --heads, --kv-heads, --head-dim), not both")
    if args.layers is None or args.head_dim is None or (args.heads is None and args.kv_heads is None):
        raise ValueError("a shape needs --layers, --head-dim and --heads or --kv-heads")
    return ModelShape(
        name="",
        architecture="",
        num_layers=args.layers,
        num_attention_heads=args.kv_heads if args.heads is None else args.heads,
        num_kv_heads=args.heads if args.kv_heads is None else args.kv_heads,
        head_dim=args.head_dim,
    )


# --- the table ---------------------------------------------------------------------------------


def render_plan(plan: KVPlan) -> str:
    """The plan as label / value lines, every byte count exact and then in binary units."""
    s = plan.shape
    heads = f"{s.num_attention_heads} heads, {s.num_kv_heads} KV heads"
    described = f"{s.num_layers} layers, {heads}, head dim {s.head_dim}"
    if s.architecture:
        described = f"{s.architecture}, {described}"
    per_token = f"{_formula(plan)} = {_bytes(plan.bytes_per_token)}"
    if plan.key.scales_per_block or plan.value.scales_per_block:
        per_token += f" at block size {plan.block_size}"
    rows = [
        ("model", f"{s.name} ({described})" if s.name else f"given shape ({described})"),
        ("K / V storage", f"{plan.key.dtype} / {plan.value.dtype}"),
        ("bytes per token", per_token),
    ]
    if plan.key.scale_bytes_per_head_block or plan.value.scale_bytes_per_head_block:
        rows += [
            (f"  K {plan.key.dtype}", _term_line(plan.key, plan)),
            (f"  V {plan.value.dtype}", _term_line(plan.value, plan)),
        ]
    if s.num_kv_heads == s.num_attention_heads:
        rows.append(("without GQA", "the same: every attention head has its own KV head"))
    else:
        saved = 1 - plan.bytes_per_token / plan.mha_bytes_per_token
        rows.append(
            (
                "without GQA",
                f"{plan.mha_bytes_per_token:,} B per token; grouped-query attention saves "
                f"{plan.gqa_saving:.1f}× ({saved:.1%})",
            )
        )
    rows += _session_rows(plan)
    if plan.staging_bytes_per_block:
        rows.append(
            (
                "staging",
                f"{_bytes(plan.staging_bytes_per_block)} per open block, in {plan.dtype} outside the "
                "pool; at most 2 per running session",
            )
        )
    return "\n".join(f"{label:<16} {value}" for label, value in rows)


def _formula(plan: KVPlan) -> str:
    s, key, value = plan.shape, plan.key, plan.value
    heads = f"{s.num_layers} layers × {s.num_kv_heads} KV heads"
    if key == value and not key.scale_bytes_per_head_block:  # the textbook case: both in the model dtype
        itemsize = Fraction(key.data_bytes_per_head_block, plan.block_size * s.head_dim)
        return f"2 × {heads} × {s.head_dim} head dim × {_num(itemsize)} B"
    k, v = (_per_token(t, plan) for t in (key, value))
    return f"{heads} × ({_num(k)} B K + {_num(v)} B V)"


def _term_line(term: StorageTerm, plan: KVPlan) -> str:
    """One of K or V per token and KV head: codes plus scales, and whether the block size matters."""
    bs, dim = plan.block_size, plan.shape.head_dim
    itemsize = Fraction(term.data_bytes_per_head_block, bs * dim)
    line = f"{dim} head dim × {_num(itemsize)} B"
    if term.scale_bytes_per_head_block:
        line += f" + {_num(Fraction(term.scale_bytes_per_head_block, bs))} B scales"
    line += f" = {_num(_per_token(term, plan))} B per KV head"
    if term.scales_per_block:
        line += f"; its scales are per {bs}-token block"
    return line


def _session_rows(plan: KVPlan) -> list[tuple[str, str]]:
    if plan.context is None or plan.blocks_per_session is None:
        return []
    assert plan.session_bytes is not None and plan.session_allocated_bytes is not None
    bs, blocks, context = plan.block_size, plan.blocks_per_session, plan.context
    per_session = f"{context:,} tokens"
    if plan.context_is_model_max:
        per_session += " (the model's context length)"
    elif plan.shape.max_context is not None and context > plan.shape.max_context:
        per_session += f" (beyond the model's {plan.shape.max_context:,}-token context)"
    rows = []
    if blocks * bs == context:
        rows.append(("per session", f"{per_session} = {blocks:,} blocks → {_bytes(plan.session_bytes)}"))
    else:
        rows.append(("per session", f"{per_session} → {_bytes(plan.session_bytes)}"))
        rows.append(
            (
                "  allocated",
                f"{blocks:,} blocks of {bs} = {blocks * bs:,} tokens "
                f"→ {_bytes(plan.session_allocated_bytes)}",
            )
        )
    if plan.pool_bytes is not None and plan.pool_blocks is not None:
        from runtime.sizes import format_bytes

        label = f"pool {format_bytes(plan.pool_bytes)}"
        if plan.pool_blocks == 0:
            rows.append(
                (label, f"holds no {bs}-token block ({_bytes(plan.bytes_per_block)}); the engine refuses it")
            )
        else:
            rows.append(
                (
                    label,
                    f"{plan.max_sessions:,} concurrent sessions of {context:,} tokens "
                    f"({plan.pool_blocks:,} blocks, {blocks:,} per session)",
                )
            )
    if plan.num_sessions is not None and plan.pool_bytes_needed is not None:
        rows.append(
            (
                f"{plan.num_sessions:,} sessions",
                f"of {context:,} tokens need a pool of {_bytes(plan.pool_bytes_needed)}: "
                f"{plan.num_sessions * blocks:,} blocks",
            )
        )
    return rows


def _per_token(term: StorageTerm, plan: KVPlan) -> Fraction:
    return Fraction(term.data_bytes_per_head_block + term.scale_bytes_per_head_block, plan.block_size)


def _num(value: Fraction) -> str:
    """Exact: ``68``, ``0.5``, ``76.25`` (per-head terms can be fractions of a byte)."""
    if value.denominator == 1:
        return f"{value.numerator:,}"
    return f"{float(value):,.6f}".rstrip("0")


def _bytes(num_bytes: int) -> str:
    from runtime.sizes import format_bytes

    return f"{num_bytes:,} B ({format_bytes(num_bytes)})"
