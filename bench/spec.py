"""Speculative decoding on an agent's work: plain decoding against prompt lookup and a draft model.

Four workloads on the default model, greedy, each through the model's chat template:
``compaction`` (the summarization request liubai's memory makes: ``memory/summarizer.py``'s
instructions over a ~1,500-token agent session, ``bench/data/spec_compaction_chat.txt``),
``code_edit`` (rename a variable in a 60-line function and return the whole function), ``quote``
(answer with the exact lines of a file in the prompt) and ``open_chat`` (a question nothing in
the prompt answers). Each runs with drafter ``off``, ``ngram`` and ``draft`` (the same model in
int4 guessing for ``--format``, bfloat16 by default) on one engine, at most ``--max-tokens``
tokens, ending at EOS; a row says how many it generated (``stopped_early`` under 32) and the
``off`` row the start of the text, since what the model writes decides what can be guessed.
With ``--format int8`` or ``int4`` the drafters are ``off`` and ``ngram`` (``--drafters``): an int4
draft of an int4 model is the model itself. ``--compile`` runs decode and verification steps
through the compiled graphs (``runtime/layers/compiled_step.py``), as ``bench.decode``'s compiled rows.

Every (workload, drafter) is warmed up once at the same shape, then timed ``--repeats`` times with
the drafters in alternating order; both prefix caches (the engine's and its draft engine's) are
emptied before every call, so each request prefills its prompt as a new one would.
``decode_tok_s`` is the engine's wall clock over the generated tokens (``(N-1)`` / first to last
token, as ``bench.decode``), the median over the repeats with its ``[min, max]``; ``speedup`` is
that median against ``off`` on the same workload.

Agreement with ``off`` on greedy sequences: ``tokens_equal`` (the same ids, every repeat);
``top1_agree`` (positions compared up to the shorter sequence, the share that hold the same
token; the worst repeat); ``first_divergence`` (the first index that differs, or null). At a
divergence, ``divergence_top2_gap`` is the gap between the two largest logits of plain decoding's
distribution there (one prefill of the prompt and ``off``'s tokens before it, through the engine's
own forward, ``runtime/engine/scoring.py``), and ``divergence_top2_gap_float32`` the same with
float32 weights, with the token each run chose there (``divergence_token_ids``) and whether those
are that forward's top two: the issue's rule is that a divergence only happens where the two
are within 1e-2. ``top1_agree`` compares free-running outputs, so one flip at a near-tie sends
the rest of the text elsewhere and the share collapses; ``top1_agree_forced`` is the agreement
given the same context (at each divergence one flip is counted, plain decoding's token forced
and the speculative run continued, ``forced_flips`` the positions): both are reported, each
judged against the 0.99 target. ``--workloads`` picks a subset. ``step_costs_ms``: the main
engine's measured cost of each decode/verification shape ("SxQ": sequences by query rows) at the
end, against which it chose how many tokens to guess (``runtime/speculation/adaptive.py``).

``float32_tokens_equal``: the four workloads again with float32 weights, ``ngram`` and ``draft``
each against ``off`` (one untimed call each); speculation must not change greedy output there.

``speedup_by_batch`` (``--sweep``, default on, off in ``--quick``): the ``quote`` prompt repeated
at batch 1, 2, 4 and 8, ``ngram`` against ``off``, on an engine whose ``speculate_max_batch`` is the
largest batch so that guessing happens at every size. A batch's rate is its decode throughput:
the generated tokens after each request's first over the time from the first request's first
token to the last request's last token. ``default_on``: the least ngram speedup over the rows
and the sweep, at every batch and up to the engine's default bound (``DEFAULT_SPECULATE_MAX_BATCH``
in ``runtime/speculation/drafter.py``), each against the 5% the default may cost, and the
largest swept batch within it.
"""

import argparse
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from bench import common
from memory.summarizer import SUMMARY_INSTRUCTIONS

DRAFTERS = ("off", "ngram", "draft")
SPECULATING = ("ngram", "draft")
WORKLOADS = ("compaction", "code_edit", "quote", "open_chat")
QUICK_WORKLOADS = ("quote", "open_chat")
SWEEP_BATCHES = (1, 2, 4, 8)
MAX_FORCED_FLIPS = 8  # top1_agree_forced stops counting after this many flips
STOPPED_EARLY_TOKENS = 32  # a row that ends at EOS before this many tokens says so
MAX_TOP2_GAP = 1e-2
MIN_TOP1 = 0.99
MAX_COST = 0.95  # speculation may be on by default where it never costs more than 5%
SPEEDUP_TARGETS = {  # (drafter, workload): least speedup against off
    ("ngram", "code_edit"): 1.5,
    ("ngram", "quote"): 1.5,
    ("ngram", "compaction"): 1.2,
    ("ngram", "open_chat"): 0.95,
    ("draft", "code_edit"): 1.5,
    ("draft", "quote"): 1.5,
}

# --- workloads -------------------------------------------------------------------------------

# An agent session as memory/summarizer.py renders it for a compaction (``transcript_line``).
COMPACTION_TRANSCRIPT = Path(__file__).resolve().parent / "data" / "spec_compaction_chat.txt"


CODE_EDIT_FUNCTION = '''\
def merge_shipments(records, warehouse_codes, cutoff_day, max_per_route=40):
    """Group shipment records by route and total them, skipping the ones we cannot use.

    Each record is a dict with "route", "warehouse", "day", "weight_kg" and "status".
    Returns (routes, skipped, x): per-route totals, the skipped records with a reason,
    and how many records were merged.
    """
    routes = {}
    skipped = []
    x = 0
    for record in records:
        route = record.get("route")
        if not route:
            skipped.append((record, "no route"))
            continue
        if record.get("warehouse") not in warehouse_codes:
            skipped.append((record, "unknown warehouse"))
            continue
        if record.get("day", 0) > cutoff_day:
            skipped.append((record, "after cutoff"))
            continue
        if record.get("status") == "cancelled":
            continue
        entry = routes.setdefault(
            route, {"weight_kg": 0.0, "shipments": 0, "warehouses": set(), "first_day": None}
        )
        if entry["shipments"] >= max_per_route:
            skipped.append((record, "route full"))
            continue
        weight = float(record.get("weight_kg") or 0.0)
        if weight <= 0:
            skipped.append((record, "no weight"))
            continue
        entry["weight_kg"] += weight
        entry["shipments"] += 1
        entry["warehouses"].add(record["warehouse"])
        day = record.get("day", 0)
        if entry["first_day"] is None or day < entry["first_day"]:
            entry["first_day"] = day
        x += 1
        if x % 1000 == 0:
            print(f"merged {x} shipments so far")

    for route, entry in routes.items():
        entry["warehouses"] = sorted(entry["warehouses"])
        entry["mean_weight_kg"] = round(entry["weight_kg"] / entry["shipments"], 2)
        entry["share"] = round(entry["shipments"] / x, 4) if x else 0.0

    if x == 0 and records:
        reasons = {}
        for _, reason in skipped:
            reasons[reason] = reasons.get(reason, 0) + 1
        worst = max(reasons, key=reasons.get) if reasons else "cancelled"
        raise ValueError(f"no shipment could be merged; most were skipped for: {worst}")

    skipped.sort(key=lambda item: (item[1], str(item[0].get("route"))))
    print(f"merged {x} shipments into {len(routes)} routes, skipped {len(skipped)}")
    return routes, skipped, x
'''

QUOTE_FILE = '''\
"""Retries for the HTTP client: which failures to retry, and how long to wait between tries."""

import random
import time

RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
MAX_ATTEMPTS = 5
BASE_DELAY_S = 0.5
MAX_DELAY_S = 30.0


class RetryError(Exception):
    """Every attempt failed; ``last`` is the final response or exception."""

    def __init__(self, attempts, last):
        super().__init__(f"gave up after {attempts} attempts: {last!r}")
        self.attempts = attempts
        self.last = last


def should_retry(status, method):
    if method not in ("GET", "HEAD", "PUT", "DELETE"):
        return status in (429, 503)
    return status in RETRY_STATUSES


def backoff_delay(attempt, retry_after=None):
    if retry_after is not None:
        return min(float(retry_after), MAX_DELAY_S)
    delay = BASE_DELAY_S * (2 ** (attempt - 1))
    return min(delay, MAX_DELAY_S) * random.uniform(0.5, 1.0)


def call_with_retries(send, request):
    for attempt in range(1, MAX_ATTEMPTS + 1):
        response = send(request)
        if not should_retry(response.status, request.method):
            return response
        time.sleep(backoff_delay(attempt, response.headers.get("Retry-After")))
    raise RetryError(MAX_ATTEMPTS, response)
'''

OPEN_CHAT_QUESTION = (
    "I just moved into a small flat with one north-facing window. What should I think about when "
    "choosing my first houseplants, and how do I avoid killing them in the first month?"
)


def workload_messages(name: str, max_tokens: int) -> list[dict[str, str]]:
    """The chat messages of workload ``name``."""
    if name == "compaction":  # memory/summarizer.py's fold prompt, no previous summary
        words = max(20, int(max_tokens * 0.6))  # the summarizer's words for a reply of max_tokens
        user = f"Previous summary:\n(none yet)\n\nNew messages:\n{COMPACTION_TRANSCRIPT.read_text().strip()}"
        return [
            {"role": "system", "content": SUMMARY_INSTRUCTIONS.format(max_words=words)},
            {"role": "user", "content": user},
        ]
    if name == "code_edit":
        ask = "Rename the variable `x` to `count` in this function and return the whole function."
        return [{"role": "user", "content": f"{ask}\n\n```python\n{CODE_EDIT_FUNCTION}```"}]
    if name == "quote":
        ask = (
            "Answer with the exact lines of this file that define `backoff_delay` and "
            "`call_with_retries`, copied character for character, and nothing else."
        )
        return [{"role": "user", "content": f"File retry.py:\n\n```python\n{QUOTE_FILE}```\n\n{ask}"}]
    if name == "open_chat":
        return [{"role": "user", "content": OPEN_CHAT_QUESTION}]
    raise ValueError(f"unknown workload {name!r}")


# --- arguments, machine ----------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--format", default="bfloat16", choices=["float32", "bfloat16", "int8", "int4"], help="main rows"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode and verification steps through liubai's compiled graphs (first compiles in the warm-up)",
    )
    parser.add_argument(
        "--drafters",
        help="comma-separated, 'off' always included (default: off,ngram,draft; off,ngram for int8/int4, "
        "whose int4 draft would be the model itself)",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="default: the engine's")
    parser.add_argument("--draft-weights", default="int4")
    parser.add_argument("--no-float32", action="store_true", help="skip the float32 equality pass")
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--sweep-tokens", type=int, default=128, help="max tokens of the batch sweep")
    parser.add_argument(
        "--workloads", help=f"comma-separated (default: all; --quick: {','.join(QUICK_WORKLOADS)})"
    )
    args = common.parse(parser)
    args.dtype = args.format  # what common.environment reports
    if args.workloads:
        args.workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
        if unknown := set(args.workloads) - set(WORKLOADS):
            parser.error(f"unknown workloads {', '.join(sorted(unknown))}; known: {', '.join(WORKLOADS)}")
    else:
        args.workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    if args.quick:
        args.max_tokens, args.repeats = 64, 1
    if args.sweep is None:
        args.sweep = not args.quick
    quantized = args.format in ("int8", "int4")
    named = [d.strip() for d in args.drafters.split(",") if d.strip()] if args.drafters else None
    if named is not None and (unknown := set(named) - set(DRAFTERS)):
        parser.error(f"unknown drafters {', '.join(sorted(unknown))}; known: {', '.join(DRAFTERS)}")
    wanted = named or (["off", "ngram"] if quantized else list(DRAFTERS))
    args.drafters = tuple(d for d in DRAFTERS if d == "off" or d in wanted)
    return args


def machine() -> dict[str, Any]:
    """The CPU (from /proc/cpuinfo) and the commit the numbers were measured at."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break

    def git(*argv: str) -> str | None:
        try:
            out = subprocess.run(["git", *argv], capture_output=True, text=True, check=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": None if status is None else bool(status),
    }


# --- running ---------------------------------------------------------------------------------


def build_engine(model_dir: str, fmt: str, args: argparse.Namespace, **overrides: Any) -> Any:
    """An engine of weight format ``fmt`` whose draft engine is built now, outside any timing."""
    kwargs: dict[str, Any] = dict(weights=fmt, kv_pool="512MiB", compile=args.compile)
    if "draft" in args.drafters:
        kwargs |= dict(speculate="draft", draft_weights=args.draft_weights)
    kwargs.update(overrides)
    return common.make_engine(model_dir, "auto", **kwargs)


def reset_caches(engine: Any) -> None:
    """Empty the engine's prefix cache and its draft engine's, so a call prefills as a new request."""
    engine.reset_prefix_cache()  # (the draft engine's too)


def run(
    engine: Any, prompts: list[list[int]], drafter: str, max_tokens: int, args: argparse.Namespace
) -> Any:
    """Greedy completions of ``prompts`` as one batch with ``drafter``, ending at EOS."""
    from runtime.engine.sampling import SamplingParams

    reset_caches(engine)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=False,
        speculate=drafter,
        num_draft_tokens=args.num_draft_tokens,
    )
    return engine.generate(prompts, params)


def agreement(reference: list[int], tokens: list[int]) -> tuple[float, int | None]:
    """Share of equal positions up to the shorter sequence, and the first index that differs (None)."""
    n = min(len(reference), len(tokens))
    equal = sum(a == b for a, b in zip(reference[:n], tokens[:n], strict=True))
    first = next((i for i in range(n) if reference[i] != tokens[i]), None)
    if first is None and len(reference) != len(tokens):
        first = n
    return (equal / n if n else 1.0), first


def top2_gap(engine: Any, prompt: list[int], prefix: list[int]) -> dict[str, Any]:
    """The two largest logits of plain decoding's distribution after ``prompt + prefix``."""

    values, ids = torch.topk(engine.prompt_logits(prompt + prefix)[-1], 2)
    return {"gap": round(float(values[0] - values[1]), 5), "top2_token_ids": ids.tolist()}


def time_workloads(
    engine: Any, prompts: dict[str, list[int]], args: argparse.Namespace
) -> dict[tuple[str, str], list]:
    """Per (workload, drafter), the timed completions, after one warm-up call each."""
    for name, ids in prompts.items():
        for drafter in args.drafters:
            common.log(f"warm-up {name} {drafter}")
            run(engine, [ids], drafter, args.max_tokens, args)
    runs: dict[tuple[str, str], list] = {(w, d): [] for w in prompts for d in args.drafters}
    for r in range(args.repeats):
        for name, ids in prompts.items():
            for drafter in common.alternating(list(args.drafters), r):
                completion = run(engine, [ids], drafter, args.max_tokens, args)[0]
                runs[name, drafter].append(completion)
                m = completion.metrics
                common.log(
                    f"repeat {r + 1}/{args.repeats} {name} {drafter}: {m.num_generated_tokens} tokens, "
                    f"{m.decode_tok_s:.1f} tok/s, ttft {m.ttft_ms:.0f} ms, accepted {m.acceptance_rate:.2f}"
                )
    return runs


def make_rows(runs: dict[tuple[str, str], list], fmt: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name, drafter in runs:
        completions, offs = runs[name, drafter], runs[name, "off"]
        rate, spread = common.median_spread([c.metrics.decode_tok_s for c in completions], 2)
        off_rate = common.median_spread([c.metrics.decode_tok_s for c in offs], 2)[0]
        compared = [agreement(o.token_ids, c.token_ids) for o, c in zip(offs, completions, strict=True)]
        if drafter == "off":  # against the first repeat: is plain decoding itself repeatable?
            compared = [agreement(offs[0].token_ids, c.token_ids) for c in completions]
        worst = min(range(len(compared)), key=lambda i: compared[i][0])
        last = completions[-1]
        n = last.metrics.num_generated_tokens
        rows.append(
            {
                "workload": name,
                "drafter": drafter,
                "format": fmt,
                "decode_tok_s": rate,
                "decode_tok_s_spread": spread,
                "speedup": 1.0 if drafter == "off" else common.ratio(rate, off_rate),
                "ttft_ms": common.median_spread([c.metrics.ttft_ms for c in completions], 1)[0],
                "num_generated_tokens": n,
                "finish_reason": last.finish_reason,
                "stopped_early": last.finish_reason == "stop" and n < STOPPED_EARLY_TOKENS,
                "acceptance_rate": None if drafter == "off" else round(last.metrics.acceptance_rate, 3),
                "mean_accepted_length": None
                if drafter == "off"
                else round(last.metrics.mean_accepted_length, 2),
                "num_drafts": last.metrics.num_drafts,
                "tokens_equal": all(c[1] is None for c in compared),
                "top1_agree": round(min(c[0] for c in compared), 4),
                "first_divergence": compared[worst][1],
                "_divergence": (
                    list(offs[worst].token_ids),
                    list(completions[worst].token_ids),
                    compared[worst][1],
                ),
                "output_head": last.text[:120] if drafter == "off" else None,
            }
        )
    return rows


def forced_agreement(
    engine: Any, prompt: list[int], reference: list[int], drafter: str, args: argparse.Namespace
) -> tuple[float, list[int]]:
    """Top-1 agreement with plain decoding given the same context: where the speculative run
    first differs, count one flip, put plain decoding's tokens up to and including that position
    into the prompt, and run on from there (at most MAX_FORCED_FLIPS times)."""
    flips: list[int] = []
    pos = 0
    while pos < len(reference) and len(flips) < MAX_FORCED_FLIPS:
        rest = reference[pos:]
        tokens = run(engine, [prompt + reference[:pos]], drafter, len(rest), args)[0].token_ids
        _share, first = agreement(rest, tokens)
        if first is None or pos + first >= len(reference):
            break
        flips.append(pos + first)
        pos += first + 1
    return 1 - len(flips) / len(reference), flips


def forced_agreements(
    rows: list[dict[str, Any]], prompts: dict[str, list[int]], engine: Any, args: argparse.Namespace
) -> None:
    """``top1_agree_forced`` and its ``forced_flips`` for every speculative row (1.0 where equal)."""
    for row in rows:
        off_tokens, _tokens, first = row["_divergence"]
        if row["drafter"] == "off":
            continue
        if first is None:
            row["top1_agree_forced"], row["forced_flips"] = 1.0, []
            continue
        share, flips = forced_agreement(engine, prompts[row["workload"]], off_tokens, row["drafter"], args)
        row["top1_agree_forced"], row["forced_flips"] = round(share, 4), flips


def divergence_gaps(rows: list[dict[str, Any]], prompts: dict[str, list[int]], engine: Any, key: str) -> None:
    """At each row's first divergence, the top-two logit gap of ``engine``'s plain forward, as ``key``."""
    for row in rows:
        off_tokens, tokens, first = row["_divergence"]
        if first is None or row["drafter"] == "off":
            continue
        gap = top2_gap(engine, prompts[row["workload"]], off_tokens[:first])
        row[key] = gap["gap"]
        row[key + "_token_ids"] = gap["top2_token_ids"]
        # The tokens each run chose there, and whether they are that forward's top two.
        chosen = [seq[first] if first < len(seq) else None for seq in (off_tokens, tokens)]
        row["divergence_token_ids"] = {"off": chosen[0], row["drafter"]: chosen[1]}
        row[key + "_is_top2"] = set(chosen) == set(gap["top2_token_ids"])


def float32_pass(
    engine: Any, prompts: dict[str, list[int]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One untimed call per workload and drafter with float32 weights, against plain decoding."""
    rows = []
    for name, ids in prompts.items():
        off = run(engine, [ids], "off", args.max_tokens, args)[0]
        for drafter in (d for d in args.drafters if d != "off"):
            completion = run(engine, [ids], drafter, args.max_tokens, args)[0]
            top1, first = agreement(off.token_ids, completion.token_ids)
            rows.append(
                {
                    "workload": name,
                    "drafter": drafter,
                    "tokens_equal": first is None,
                    "top1_agree": round(top1, 4),
                    "first_divergence": first,
                    "num_generated_tokens": len(completion.token_ids),
                    "acceptance_rate": round(completion.metrics.acceptance_rate, 3),
                }
            )
            common.log(f"float32 {name} {drafter}: tokens equal {first is None}")
    return rows


def batch_throughput(completions: list[Any]) -> float | None:
    """Tokens after each request's first over the first request's first token to the last's last."""
    starts = [c.metrics.ttft_ms for c in completions]  # the requests arrive together
    ends = [c.metrics.ttft_ms + c.metrics.decode_ms for c in completions]
    window_s = (max(ends) - min(starts)) / 1000
    tokens = sum(max(0, c.metrics.num_generated_tokens - 1) for c in completions)
    return tokens / window_s if window_s > 0 else None


def sweep(model_dir: str, prompt: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """ngram against off on ``prompt`` repeated at each batch of SWEEP_BATCHES."""
    engine = common.make_engine(
        model_dir,
        "auto",
        weights=args.format,
        kv_pool="512MiB",
        speculate_max_batch=max(SWEEP_BATCHES),
        compile=args.compile,
    )
    drafters = ["off", "ngram"]
    for batch in SWEEP_BATCHES:
        for drafter in drafters:
            run(engine, [prompt] * batch, drafter, args.sweep_tokens, args)
    rates: dict[tuple[int, str], list[float | None]] = {(b, d): [] for b in SWEEP_BATCHES for d in drafters}
    accepted: dict[int, float] = {}
    for r in range(args.repeats):
        for batch in SWEEP_BATCHES:
            for drafter in common.alternating(drafters, r):
                completions = run(engine, [prompt] * batch, drafter, args.sweep_tokens, args)
                rates[batch, drafter].append(batch_throughput(completions))
                if drafter == "ngram":
                    accepted[batch] = sum(c.metrics.acceptance_rate for c in completions) / batch
                common.log(
                    f"sweep repeat {r + 1} batch {batch} {drafter}: {rates[batch, drafter][-1]:.1f} tok/s"
                )
    rows = []
    for batch in SWEEP_BATCHES:
        off, off_spread = common.median_spread(rates[batch, "off"], 2)
        ngram, ngram_spread = common.median_spread(rates[batch, "ngram"], 2)
        rows.append(
            {
                "batch": batch,
                "off_tok_s": off,
                "off_tok_s_spread": off_spread,
                "ngram_tok_s": ngram,
                "ngram_tok_s_spread": ngram_spread,
                "speedup": common.ratio(ngram, off),
                "acceptance_rate": round(accepted[batch], 3),
            }
        )
    return rows


# --- report ----------------------------------------------------------------------------------


def judge(
    rows: list[dict[str, Any]],
    float32_equal: bool | None,
    sweep_rows: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each target's value and verdict, and what the numbers say about speculation by default:
    at every batch, and up to the engine's default ``speculate_max_batch``."""
    from runtime.speculation.drafter import DEFAULT_SPECULATE_MAX_BATCH

    by = {(r["drafter"], r["workload"]): r for r in rows}
    targets: dict[str, Any] = {
        "float32_tokens_equal": {"value": float32_equal, "target": True, "pass": float32_equal is True}
    }
    forced = min((r["top1_agree_forced"] for r in rows if "top1_agree_forced" in r), default=None)
    targets["top1_agree_forced_every_row"] = {
        "value": forced,
        "target": f">= {MIN_TOP1}",
        "pass": forced is not None and forced >= MIN_TOP1,
    }
    top1 = min((r["top1_agree"] for r in rows), default=None)
    targets["top1_agree_every_row"] = {
        "value": top1,
        "target": f">= {MIN_TOP1}",
        "pass": top1 is not None and top1 >= MIN_TOP1,
    }
    gaps = [r["divergence_top2_gap"] for r in rows if "divergence_top2_gap" in r]
    worst_gap = max(gaps, default=None)
    targets["divergence_top2_gap"] = {
        "value": worst_gap,
        "target": f"<= {MAX_TOP2_GAP} (every divergence)",
        "pass": worst_gap is None or worst_gap <= MAX_TOP2_GAP,
        "num_divergences": len(gaps),
    }
    for (drafter, workload), wanted in SPEEDUP_TARGETS.items():
        if (row := by.get((drafter, workload))) is not None:
            speedup = row["speedup"]
            targets[f"{drafter}_{workload}_speedup"] = {
                "value": speedup,
                "target": f">= {wanted}",
                "pass": speedup is not None and speedup >= wanted,
            }
    default_on: dict[str, Any] = {}
    for drafter in (d for d in SPECULATING if any(r["drafter"] == d for r in rows)):
        speedups = [r["speedup"] for r in rows if r["drafter"] == drafter and r["speedup"] is not None]
        if drafter == "ngram":
            speedups += [s["speedup"] for s in sweep_rows if s["speedup"] is not None]
        least = min(speedups, default=None)
        default_on[drafter] = {
            "min_speedup": least,
            "never_costs_more_than_5pct": least is not None and least >= MAX_COST,
        }
        if drafter == "ngram" and sweep_rows:
            bound = DEFAULT_SPECULATE_MAX_BATCH
            bounded = [r["speedup"] for r in rows if r["drafter"] == drafter and r["speedup"] is not None]
            bounded += [s["speedup"] for s in sweep_rows if s["speedup"] is not None and s["batch"] <= bound]
            least = min(bounded, default=None)
            default_on[drafter] |= {
                "engine_max_batch": bound,
                "min_speedup_within_engine_max_batch": least,
                "within_5pct_up_to_engine_max_batch": least is not None and least >= MAX_COST,
            }
    within = None
    for s in sweep_rows:
        if s["speedup"] is None or s["speedup"] < MAX_COST:
            break
        within = s["batch"]
    default_on["max_batch_within_5pct"] = within if sweep_rows else None
    return targets, default_on


def print_table(
    rows: list[dict[str, Any]], float32_rows: list[dict[str, Any]], sweep_rows: list[dict[str, Any]]
) -> None:
    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    header = (
        "workload",
        "drafter",
        "format",
        "tok/s",
        "spread",
        "speedup",
        "ttft_ms",
        "gen",
        "accept",
        "mean_len",
        "equal",
        "top1",
        "forced",
        "diverge",
        "gap",
    )
    lines = [header]
    for r in rows:
        lines.append(
            (
                r["workload"],
                r["drafter"],
                r["format"],
                cell(r["decode_tok_s"]),
                cell(r["decode_tok_s_spread"]),
                cell(r["speedup"]),
                cell(r["ttft_ms"]),
                f"{r['num_generated_tokens']}{' (early stop)' if r['stopped_early'] else ''}",
                cell(r["acceptance_rate"]),
                cell(r["mean_accepted_length"]),
                cell(r["tokens_equal"]),
                cell(r["top1_agree"]),
                cell(r.get("top1_agree_forced")),
                cell(r["first_divergence"]),
                cell(r.get("divergence_top2_gap")),
            )
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(str(v).ljust(w) for v, w in zip(line, widths, strict=True)))
    if float32_rows:
        print()
        for r in float32_rows:
            print(
                f"float32 {r['workload']:<10} {r['drafter']:<5} tokens_equal {r['tokens_equal']}  "
                f"top1 {r['top1_agree']}  diverge {cell(r['first_divergence'])}  "
                f"accept {r['acceptance_rate']}"
            )
    if sweep_rows:
        print()
        for s in sweep_rows:
            print(
                f"batch {s['batch']}: off {cell(s['off_tok_s'])} tok/s, "
                f"ngram {cell(s['ngram_tok_s'])} tok/s, "
                f"speedup {cell(s['speedup'])}, accept {s['acceptance_rate']}"
            )
    print(flush=True)


def main() -> None:
    args = parse_args()
    label = machine()  # now: the tree whose modules this process imports, not the one at the end
    model_dir = common.resolve_model_dir(args.model)
    engine = build_engine(model_dir, args.format, args)
    prompts = {
        name: common.chat_ids(engine.tokenizer, workload_messages(name, args.max_tokens))
        for name in args.workloads
    }
    common.log(
        f"{args.format}, prompts { ({n: len(p) for n, p in prompts.items()}) }, {args.max_tokens} tokens"
    )

    rows = make_rows(time_workloads(engine, prompts, args), args.format, args)
    divergence_gaps(rows, prompts, engine, "divergence_top2_gap")
    forced_agreements(rows, prompts, engine, args)
    step_costs_ms = engine.step_costs.snapshot()
    del engine

    float32_rows: list[dict[str, Any]] = []
    float32_equal: bool | None = None
    if args.format == "float32":
        float32_equal = all(r["tokens_equal"] for r in rows)
    elif not args.no_float32:
        reference = build_engine(model_dir, "float32", args)
        float32_rows = float32_pass(reference, prompts, args)
        float32_equal = all(r["tokens_equal"] for r in float32_rows)
        divergence_gaps(rows, prompts, reference, "divergence_top2_gap_float32")
        del reference
    sweep_rows = (
        sweep(model_dir, prompts.get("quote") or next(iter(prompts.values())), args) if args.sweep else []
    )

    for row in rows:
        del row["_divergence"]
    targets, default_on = judge(rows, float32_equal, sweep_rows)
    print_table(rows, float32_rows, sweep_rows)
    result: dict[str, Any] = {
        "rows": rows,
        "float32_tokens_equal": float32_equal,
        "float32_rows": float32_rows,
        "speedup_by_batch": {str(s["batch"]): s["speedup"] for s in sweep_rows},
        "sweep": sweep_rows,
        "targets": targets,
        "meets_targets": all(t["pass"] for t in targets.values()),
        "default_on": default_on,
        "prompt_tokens": {name: len(ids) for name, ids in prompts.items()},
        "max_tokens": args.max_tokens,
        "sweep_tokens": args.sweep_tokens if args.sweep else None,
        "repeats": args.repeats,
        "draft_weights": args.draft_weights,
        "num_draft_tokens": args.num_draft_tokens,
        "step_costs_ms": step_costs_ms,
        **label,
        **common.environment(args, model_dir),
    }
    common.emit("spec", result)


if __name__ == "__main__":
    main()
