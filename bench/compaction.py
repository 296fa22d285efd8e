"""Compaction under a KV byte budget: the same long chat with the model's own KV dtype and with int8.

A scripted chat of ``--turns`` turns (default 100) runs through liubai's memory layer under one
KV budget in bytes, once per KV dtype. Its user messages are made-up archive notes of about
``--user-words`` words, built offline from a seed; five early turns plant distinctive facts (a
locker code, a name, a password, a date, a codename) and the last five ask about them, long
after compaction has taken their turns out of the live context. The budget is converted to
tokens with the engine's exact bytes per token, so the int8 run holds 1.9 times the tokens of a
bfloat16 cache (the model dtype by default) and 3.8 times those of a float32 one.

Two kinds of rows, side by side (``--methods``):

- ``free_running``: each dtype's run writes its own replies, the model's greedy ones (at most
  ``--reply-tokens`` tokens), as a user of that dtype would get them. How long those replies
  come out differs between dtypes, and with it how many turns a budget holds; that is part of
  what a user of a quantized cache gets. The proportion targets are judged on these rows.
- ``replayed``: the later dtypes hold the first dtype's free-running conversation instead (each
  turn's request still runs and generates, but the first run's reply is the one stored), so the
  dtypes differ only in what a token costs, and live turns in proportion become nearly
  arithmetic from bytes per token. A stored reply that is not the one generated cannot be
  served from the prefix cache, so these rows' ``prefill_tokens_saved`` is not comparable with
  the free-running ones. The first dtype's replayed row is its free-running row.

The answers to the five questions and the summaries are always the model's own.

Each row runs the chat twice on one engine: with recall (the real configuration), then
with a ``recall=False`` context manager that replays the recall run's replies and generates only
the answers to the five questions, so the two runs differ only in recall.

Per run: ``budget_tokens`` (what the byte budget holds at this dtype); ``max_kv_tokens_seen``
(prompt + generated, the most any request held: turns and compaction's summarization requests,
both runs); ``compactions`` and ``compaction_ms_mean`` (recall run); ``live_turns_mean`` (completed
turns with live messages in the prompt, averaged over whole compaction cycles before the five
questions, when the budget, not the chat's length, decides it), with
``live_history_tokens_mean`` (their tokens) and ``overhead_tokens_mean`` (the rest of each
request's KV: system prompt, summary, recall note, the new message and the reply reserve, a
cost in tokens that does not shrink with the budget); ``messages_lost`` (messages added but not in
the database byte for byte, both runs); ``facts_in_prompt`` (questions whose prompt held the
fact's original text); ``facts_answered_recall_on`` / ``_off`` (replies containing the fact's key);
``prefill_tokens_saved`` (sum of the engine's ``num_cached_tokens`` over the recall run's requests).

The fact ledger (``memory/fact_ledger.py``): ``facts_in_summary`` (with recall off, questions
whose prompt's summary section holds the fact's key, i.e. the kept-verbatim list or the prose
kept it); ``ledger_tokens_mean`` (tokens of the kept-verbatim list per compaction, recall run);
``facts_answered_paraphrased`` (two more replayed passes ask each question in words it shares
with no planted fact: "Which digits open my depot unit?" for the locker code; this pass recalls
through the ledger and full-text search) and ``facts_answered_paraphrased_fts_only`` (the same
questions, recall by full-text search alone), all measured in the same run. The paraphrases use
words of ``memory/lexicon.py``'s synonym groups, which were written with such questions in
mind: the figure shows what the ledger lookup does when the lexicon covers the words, not how
often it does for questions in the wild.

``targets`` judges the free-running rows; the proportion of int8 to the model dtype's live
history (``live_history_tokens_ratio``: what the budget buys) and of live turns
(``live_turns_ratio``) are each checked against the bytes-per-token ratio, within 15%.
``targets_replayed`` gives the same checks on the replayed rows, for comparison.
"""

import argparse
import gc
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from bench import common

SYSTEM = "You are a helpful assistant. Answer briefly."
FP32_BYTES_PER_TOKEN = 46080  # SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 dims x 4 bytes


@dataclass(frozen=True, slots=True)
class Fact:
    text: str
    question: str
    key: str  # the token a correct answer contains


FACTS = (
    Fact("Please remember this: my storage locker code is 4817.", "What is my storage locker code?", "4817"),
    Fact("Please remember this: my sister is called Ottoline.", "What is my sister called?", "Ottoline"),
    Fact(
        "Please remember this: the wifi password at the cabin is marmalade77.",
        "What is the wifi password at the cabin?",
        "marmalade77",
    ),
    Fact(
        "Please remember this: my dentist appointment is on the 14th of March.",
        "When is my dentist appointment?",
        "14",
    ),
    Fact(
        "Please remember this: our secret project codename is Bluefinch.",
        "What is our secret project codename?",
        "Bluefinch",
    ),
)
FACT_TURNS = (2, 4, 6, 8, 10)
# Each question again, sharing no word with its fact (checked in ``paraphrased_script``).
PARAPHRASES = (
    "Which digits open my depot unit?",
    "What name did I give for my sibling?",
    "What passphrase gets me onto the lodge's network?",
    "When is my dental checkup?",
    "What do we call the confidential plan?",
)


def parse_args() -> argparse.Namespace:
    parser = common.base_parser(__doc__.splitlines()[0])
    # bfloat16 by default: int8 holds 3.8x the tokens of a float32 cache, so a byte budget whose
    # int8 run fits SmolLM2's 8,192-token context leaves the float32 run 2,000 tokens, a tenth of
    # which is what every request carries besides the history; at 2 bytes the auto run gets
    # 4,000 and that share halves. ``--dtype float32`` measures the other case.
    parser.set_defaults(dtype="bfloat16")
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument(
        "--budget-bytes",
        type=int,
        default=2000 * FP32_BYTES_PER_TOKEN,
        help="the KV budget of every run (default 92,160,000: 4,000 bf16 tokens, 7,641 int8 ones)",
    )
    # Short turns and a small summary keep what every request carries besides the history (system
    # prompt, summary, new message, reserve) small against both budgets, so the live history (and
    # with it the live turns) scales with the tokens each dtype's bytes buy.
    parser.add_argument("--user-words", type=int, default=50, help="words per scripted user message")
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--reserve-tokens", type=int, default=32, help="the budget's reply reserve")
    parser.add_argument("--summary-tokens", type=int, default=64, help="most tokens a summary may take")
    parser.add_argument("--kv-dtypes", default="auto,int8")
    parser.add_argument(
        "--methods",
        default="free,replayed",
        help="free: each dtype writes its own replies; replayed: later dtypes replay the first's",
    )
    args = common.parse(parser)
    args.methods = {m.strip() for m in args.methods.split(",")}
    if not args.methods or not args.methods <= {"free", "replayed"}:
        parser.error("--methods takes free, replayed or both")
    if args.quick:
        args.turns, args.budget_bytes = 24, 1000 * FP32_BYTES_PER_TOKEN
        args.user_words, args.reply_tokens = 120, 16
    if args.turns < FACT_TURNS[-1] + 2 * len(FACTS):
        parser.error(f"--turns must be at least {FACT_TURNS[-1] + 2 * len(FACTS)}")
    return args


def script(turns: int, user_words: int) -> list[str]:
    """The user's messages: archive notes, five facts early, the five questions last."""
    messages = [
        f"Notes from the archive, part {turn}: {common.filler_text(500 + turn, user_words)} "
        "What stands out in these notes?"
        for turn in range(1, turns + 1)
    ]
    for fact, turn in zip(FACTS, FACT_TURNS, strict=True):
        messages[turn - 1] = fact.text
    for i, fact in enumerate(FACTS):
        messages[turns - len(FACTS) + i] = fact.question
    return messages


def paraphrased_script(messages: list[str]) -> list[str]:
    """The script with its five questions asked in other words than their facts'."""
    from memory.lexicon import content_words

    for fact, paraphrase in zip(FACTS, PARAPHRASES, strict=True):
        shared = set(content_words(fact.text)) & set(content_words(paraphrase))
        assert not shared, f"{paraphrase!r} shares {shared} with its fact"
    return messages[: len(messages) - len(FACTS)] + list(PARAPHRASES)


@dataclass(slots=True)
class Conversation:
    """What one pass of the chat measured."""

    replies: list[str] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)  # per request, turns and summaries
    cached_tokens: list[int] = field(default_factory=list)
    live_turns: list[int] = field(default_factory=list)  # per turn request
    history_tokens: list[int] = field(default_factory=list)  # tokens of those live turns
    overhead_tokens: list[int] = field(default_factory=list)  # the rest of the request's KV
    summary_tokens: list[int] = field(default_factory=list)  # per compaction
    compaction_turns: list[int] = field(default_factory=list)
    compaction_ms: list[float] = field(default_factory=list)
    facts_in_prompt: int = 0
    facts_in_summary: int = 0  # questions whose prompt's summary section held the fact's key
    facts_answered: int = 0
    ledger_tokens: list[int] = field(default_factory=list)  # the kept-verbatim list, per compaction
    messages_lost: int = 0


def converse(
    backend: Any,
    store: Any,
    messages: list[str],
    args: argparse.Namespace,
    recall: bool,
    replay: list[str],
    request_replayed: bool,
    ledger_recall: bool = True,
) -> Conversation:
    """One pass of the chat; with ``replay``, its replies are stored except for the questions.

    With ``request_replayed`` each replayed turn still runs its request (prefill and up to
    ``--reply-tokens`` of generation, discarded), so the engine holds what a live chat holds.
    """
    from memory import ContextManager
    from memory.fact_ledger import prose_of
    from memory.prompt_layout import SUMMARY_HEADER

    out = Conversation()

    def on_event(event: Any) -> None:
        out.compaction_ms.append(event.duration_ms)
        out.summary_tokens.append(event.summary_tokens)
        listed = (event.summary_text or "")[len(prose_of(event.summary_text)) :]
        out.ledger_tokens.append(len(backend.tokenizer.encode(listed, add_special_tokens=False)))

    def on_request(kind: str, metrics: Any, kv_tokens: int) -> None:
        out.kv_tokens.append(kv_tokens)
        out.cached_tokens.append(metrics.num_cached_tokens)

    manager = ContextManager.create(
        store,
        backend,
        system=SYSTEM,
        budget=f"{args.budget_bytes}B",
        reserve_tokens=args.reserve_tokens,
        recall=recall,
        ledger_recall=ledger_recall,
        max_summary_tokens=args.summary_tokens,
        on_event=on_event,
        on_request=on_request,
    )
    added: list[tuple[str, str]] = []
    first_question = len(messages) - len(FACTS)
    for turn, text in enumerate(messages, start=1):
        manager.add_user(text)
        added.append(("user", text))
        prompt = manager.next_prompt()
        if prompt.compactions:
            out.compaction_turns.append(turn)
        live = {m.turn for m in manager.live_messages() if m.kind == "chat" and m.turn != turn}
        out.live_turns.append(len(live))
        history = prompt.sections["pinned"] + prompt.sections["recent"]
        out.history_tokens.append(history)
        out.overhead_tokens.append(prompt.num_tokens - history + args.reserve_tokens)
        fact = FACTS[turn - 1 - first_question] if turn > first_question else None
        if replay and fact is None:
            if request_replayed:
                ask(backend, prompt, args, out)
            reply = replay[turn - 1]
        else:
            reply = ask(backend, prompt, args, out)
        if fact is not None:
            out.facts_in_prompt += any(fact.text in m["content"] for m in prompt.messages)
            summary = [m["content"] for m in prompt.messages if m["content"].startswith(SUMMARY_HEADER)]
            out.facts_in_summary += any(fact.key.lower() in text.lower() for text in summary)
            out.facts_answered += fact.key.lower() in reply.lower()
            common.log(f"  Q: {fact.question} -> {reply.strip()[:80]!r}")
        manager.add_assistant(reply)
        added.append(("assistant", reply))
        out.replies.append(reply)
        if turn % 10 == 0 or prompt.compactions:
            common.log(
                f"  turn {turn}: {prompt.num_tokens} prompt tokens, {len(live)} live turns, "
                f"{len(out.compaction_ms)} compactions"
            )
    stored = [(m.role, m.content) for m in store.messages(manager.session_id) if m.kind == "chat"]
    out.messages_lost = sum(1 for a, b in zip(added, stored, strict=False) if a != b) + abs(
        len(added) - len(stored)
    )
    return out


def ask(backend: Any, prompt: Any, args: argparse.Namespace, out: Conversation) -> str:
    """One greedy turn request; its KV and prefix-cache hit go into ``out``."""
    params = common.sampling(min(args.reply_tokens, prompt.max_tokens), ignore_eos=False)
    parts: list[str] = []
    metrics = None
    for delta in backend.stream(prompt.chat_prompt(), params):
        parts.append(delta.text)
        metrics = delta.metrics or metrics
    assert metrics is not None
    out.kv_tokens.append(prompt.num_tokens + metrics.num_generated_tokens)
    out.cached_tokens.append(metrics.num_cached_tokens)
    return "".join(parts)


def steady_window(compaction_turns: list[int], first_question: int) -> slice:
    """The turns (0-based slice) over which live turns are averaged: whole compaction cycles.

    Live turns rise from the low watermark to the high one and drop at each compaction; a mean
    over a window that ends mid-cycle depends on where the chat happens to stop. So the window
    runs from the first compaction to the last one before the five questions (short turns that
    would inflate the count), or, with fewer than two, from the first compaction to them.
    """
    before = [t for t in compaction_turns if t < first_question]
    if not before:
        return slice(0, first_question - 1)
    if len(before) == 1:
        return slice(before[0] - 1, first_question - 1)
    return slice(before[0] - 1, before[-1] - 1)


def run_dtype(
    model_dir: str, kv_dtype: str, messages: list[str], args: argparse.Namespace, reference: list[str]
) -> tuple[dict[str, Any], list[str]]:
    """One KV dtype's runs, and the replies its recall run stored.

    With ``reference`` (the first dtype's replies) the recall run holds that same conversation,
    so what differs between dtypes is the bytes each token costs, not how long the replies the
    model wrote with a quantized cache happen to be.
    """
    from memory import Budget, Store
    from runtime.backends.backend import LocalBackend

    engine = common.make_engine(model_dir, args.dtype, kv_dtype=kv_dtype)
    backend = LocalBackend(engine)
    budget_tokens = Budget.from_spec(
        f"{args.budget_bytes}B", backend.bytes_per_token, backend.max_context_tokens
    ).tokens
    method = "replayed" if reference else "free-running"
    common.log(f"{kv_dtype} ({method}): {backend.bytes_per_token} bytes per token, {budget_tokens} tokens")
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "compaction.db")
        common.log(f"{kv_dtype}: recall on")
        on = converse(backend, store, messages, args, recall=True, replay=reference, request_replayed=True)
        engine.reset_prefix_cache()
        common.log(f"{kv_dtype}: recall off (replaying the replies)")
        off = converse(
            backend, store, messages, args, recall=False, replay=on.replies, request_replayed=False
        )
        paraphrased = paraphrased_script(messages)
        engine.reset_prefix_cache()
        common.log(f"{kv_dtype}: paraphrased questions, recall by the ledger and full-text search")
        para = converse(
            backend, store, paraphrased, args, recall=True, replay=on.replies, request_replayed=False
        )
        engine.reset_prefix_cache()
        common.log(f"{kv_dtype}: paraphrased questions, recall by full-text search alone")
        para_fts = converse(
            backend,
            store,
            paraphrased,
            args,
            recall=True,
            replay=on.replies,
            request_replayed=False,
            ledger_recall=False,
        )
        store.close()
    window = steady_window(on.compaction_turns, len(messages) - len(FACTS) + 1)
    run = {
        "kv_dtype": kv_dtype,
        "method": method,
        "replies": "the first dtype's free-running ones, replayed" if reference else "this run's own",
        "bytes_per_token": backend.bytes_per_token,
        "budget_bytes": args.budget_bytes,
        "budget_tokens": budget_tokens,
        "live_turns_mean": round(mean(on.live_turns[window]), 2),
        "live_turns_window": [window.start + 1, window.stop],
        "live_history_tokens_mean": round(mean(on.history_tokens[window])),
        "overhead_tokens_mean": round(mean(on.overhead_tokens[window])),
        "summary_tokens_mean": round(mean(on.summary_tokens)) if on.summary_tokens else None,
        "max_kv_tokens_seen": max(on.kv_tokens + off.kv_tokens),
        "compactions": len(on.compaction_ms),
        "compaction_turns": on.compaction_turns,
        "compaction_ms_mean": round(mean(on.compaction_ms), 1) if on.compaction_ms else None,
        "messages_lost": on.messages_lost + off.messages_lost + para.messages_lost + para_fts.messages_lost,
        "facts_in_prompt": on.facts_in_prompt,
        "facts_answered_recall_on": on.facts_answered,
        "facts_answered_recall_off": off.facts_answered,
        "facts_in_prompt_recall_off": off.facts_in_prompt,
        "facts_in_summary": off.facts_in_summary,
        "facts_answered_paraphrased": para.facts_answered,
        "facts_answered_paraphrased_fts_only": para_fts.facts_answered,
        "facts_in_prompt_paraphrased": para.facts_in_prompt,
        "facts_in_prompt_paraphrased_fts_only": para_fts.facts_in_prompt,
        "ledger_tokens_mean": round(mean(on.ledger_tokens), 1) if on.ledger_tokens else None,
        "prefill_tokens_saved": sum(on.cached_tokens),
        "requests": len(on.kv_tokens),
        "engine_stats": engine.stats().to_dict(),
    }
    return run, on.replies


def targets(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, checked on one kind of row (free-running or replayed)."""
    checks: dict[str, Any] = {
        "kv_within_budget": all(r["max_kv_tokens_seen"] <= r["budget_tokens"] for r in runs),
        "no_message_lost": all(r["messages_lost"] == 0 for r in runs),
        "all_facts_in_prompt": all(r["facts_in_prompt"] == len(FACTS) for r in runs),
        "recall_helps": all(r["facts_answered_recall_on"] > r["facts_answered_recall_off"] for r in runs),
        "all_facts_in_summary": all(r["facts_in_summary"] == len(FACTS) for r in runs),
        "ledger_recall_gains_2": all(
            r["facts_answered_paraphrased"] >= r["facts_answered_paraphrased_fts_only"] + 2 for r in runs
        ),
    }
    by_dtype = {r["kv_dtype"]: r for r in runs}
    if "auto" in by_dtype and "int8" in by_dtype:
        auto, int8 = by_dtype["auto"], by_dtype["int8"]
        expected = auto["bytes_per_token"] / int8["bytes_per_token"]
        turns = common.ratio(int8["live_turns_mean"], auto["live_turns_mean"])
        tokens = common.ratio(int8["live_history_tokens_mean"], auto["live_history_tokens_mean"])
        checks["bytes_per_token_ratio"] = round(expected, 3)
        checks["live_history_tokens_ratio"] = tokens
        checks["live_turns_ratio"] = turns
        checks["live_history_tokens_in_proportion"] = in_proportion(tokens, expected)
        checks["live_turns_in_proportion"] = in_proportion(turns, expected)
    return checks


def in_proportion(measured: float | None, expected: float, tolerance: float = 0.15) -> bool:
    return measured is not None and abs(measured / expected - 1) <= tolerance


def main() -> None:
    args = parse_args()
    model_dir = common.resolve_model_dir(args.model)
    messages = script(args.turns, args.user_words)
    kv_dtypes = [d.strip() for d in args.kv_dtypes.split(",")]
    # The first dtype's free-running run is the replay's reference, so it always runs.
    first, reference = run_dtype(model_dir, kv_dtypes[0], messages, args, [])
    gc.collect()
    free, replayed = [first], [first]
    for kv_dtype in kv_dtypes[1:]:
        if "free" in args.methods:
            free.append(run_dtype(model_dir, kv_dtype, messages, args, [])[0])
            gc.collect()
        if "replayed" in args.methods:
            replayed.append(run_dtype(model_dir, kv_dtype, messages, args, reference)[0])
            gc.collect()
    result: dict[str, Any] = {
        "benchmark": "compaction",
        "targets": targets(free),
        "targets_replayed": targets(replayed) if "replayed" in args.methods else None,
        "free_running": free,
        "replayed": replayed[1:] if "replayed" in args.methods else None,
        "replay_reference": f"free_running {kv_dtypes[0]} row (its replies are the model's)",
        "turns": args.turns,
        "user_words": args.user_words,
        "reply_tokens": args.reply_tokens,
        "reserve_tokens": args.reserve_tokens,
        "facts": len(FACTS),
        **common.environment(args, model_dir),
    }
    common.emit("compaction", result)


if __name__ == "__main__":
    main()
