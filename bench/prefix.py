"""Prefix caching across a multi-turn chat: liubai's prefix cache against re-sending everything.

A conversation opens with a ~1,000-token system prompt (a made-up policy document, built
offline from a seed) and runs ``--turns`` turns. Each turn appends a user question, sends the
whole history through the chat template, and appends the model's greedy reply (at most
``--reply-tokens`` tokens, ending at EOS). liubai streams the turn on one engine, so every
turn after the first should find the history in its prefix cache and prefill only the new
tail; transformers ``generate()`` gets the same ids and recomputes them all, its time to first
token measured as a 1-token call. liubai's wall-clock TTFT is the time to its first streamed
delta. The replies in the history are liubai's, so both peers see identical prompts.

The conversation runs ``--repeats`` times with different documents (no cross-conversation
hits) and each turn keeps its best TTFT per peer. ``hit_rate`` is cached / prompt tokens over
turns 2..N from the engine's metrics; ``ttft_ratio_last_turn`` is liubai / transformers.
"""

import argparse
import random
from typing import Any

from bench import common

_SECTIONS = (
    "Scope",
    "Retention of records",
    "Access to the reading room",
    "Handling of fragile scrolls",
    "Copying and transcription",
    "Loans between archives",
    "Disputes over provenance",
    "Fire and flood",
    "Seals and signatures",
    "Audits",
    "Training of scribes",
    "Amendments",
)
_QUESTIONS = (
    "Who may enter the reading room, and when?",
    "How long must tax ledgers be kept before they may be summarised?",
    "What should a scribe do first when a scroll is found damaged by water?",
    "Can an archive lend an original charter to a neighbouring council?",
    "Who settles a dispute over where a record came from?",
    "Summarise the duties of the keeper in three sentences.",
    "Which sections changed in the last amendment?",
    "What happens to records nobody has read for a century?",
)


def parse_args() -> argparse.Namespace:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="conversations, each with its own document")
    args = common.parse(parser)
    if args.quick:
        args.turns, args.system_tokens, args.reply_tokens, args.repeats = 3, 200, 8, 1
    if not 2 <= args.turns <= len(_QUESTIONS):
        parser.error(f"--turns must be between 2 and {len(_QUESTIONS)}")
    return args


def policy_document(tokenizer: Any, seed: int, num_tokens: int) -> str:
    """A numbered policy of about ``num_tokens`` tokens; the seed changes its very first line."""
    rng = random.Random(seed)
    parts = [f"Archive policy {seed:04d}, binding on every keeper and scribe of the archive."]
    for number, title in enumerate(_SECTIONS * 4, start=1):
        clauses = [
            f"{number}.{i} {common.filler_text(rng.randrange(10**6), rng.randint(15, 30))}"
            for i in range(1, rng.randint(2, 4))
        ]
        parts.append(f"Section {number}. {title}.\n" + "\n".join(clauses))
    ids = tokenizer.encode("\n\n".join(parts), add_special_tokens=False)
    return tokenizer.decode(ids[:num_tokens])


def liubai_turn(engine: Any, ids: list[int], max_tokens: int) -> tuple[float, Any, str]:
    """Wall-clock TTFT (ms), the engine's metrics and the reply text of one streamed turn."""
    texts: list[str] = []
    first_ms, metrics = 0.0, None
    start = common.now()
    for delta in engine.stream(ids, common.sampling(max_tokens, ignore_eos=False)):
        first_ms = first_ms or (common.now() - start) * 1000
        texts.append(delta.text)
        metrics = delta.metrics or metrics
    return first_ms, metrics, "".join(texts)


def conversation(engine: Any, hf_model: Any, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """One conversation; per turn the two TTFTs and liubai's token accounting."""
    tokenizer = engine.tokenizer
    history = [{"role": "system", "content": policy_document(tokenizer, seed, args.system_tokens)}]
    turns = []
    for turn, question in enumerate(_QUESTIONS[: args.turns], start=1):
        history.append({"role": "user", "content": question})
        ids = common.chat_ids(tokenizer, history)
        ttft_ms, metrics, reply = liubai_turn(engine, ids, args.reply_tokens)
        hf_s = common.timed(common.hf_generate, hf_model, ids, 1)[1]
        history.append({"role": "assistant", "content": reply})
        turns.append(
            {
                "prompt": metrics.num_prompt_tokens,
                "cached": metrics.num_cached_tokens,
                "prefilled": metrics.num_prefilled_tokens,
                "liubai_ms": ttft_ms,
                "engine_ms": metrics.ttft_ms,
                "hf_ms": hf_s * 1000,
            }
        )
        common.log(
            f"seed {seed} turn {turn}: {len(ids)} prompt tokens, {metrics.num_cached_tokens} cached; "
            f"ttft liubai {ttft_ms:.0f} ms, transformers {hf_s * 1000:.0f} ms"
        )
    return turns


def main() -> None:
    args = parse_args()
    model_dir = common.resolve_model_dir(args.model)
    engine = common.make_engine(model_dir, args.dtype)
    hf_model = common.load_hf(model_dir, args.dtype)
    warm = common.chat_prompt(engine.tokenizer, 9999, 64)
    engine.generate([warm], common.sampling(4))
    common.hf_generate(hf_model, warm, 4)

    runs = [conversation(engine, hf_model, args, seed) for seed in range(1, args.repeats + 1)]
    first = runs[0]

    def best(key: str) -> list[float]:
        return [round(min(run[t][key] for run in runs), 1) for t in range(args.turns)]

    later = [turn for run in runs for turn in run[1:]]
    liubai_ms, hf_ms = best("liubai_ms"), best("hf_ms")
    result: dict[str, Any] = {
        "hit_rate": round(sum(t["cached"] for t in later) / sum(t["prompt"] for t in later), 3),
        "ttft_ratio_last_turn": common.ratio(liubai_ms[-1], hf_ms[-1]),
        "prefill_tokens_per_turn": [t["prefilled"] for t in first],
        "liubai_ttft_ms_per_turn": liubai_ms,
        "hf_ttft_ms_per_turn": hf_ms,
        "liubai_engine_ttft_ms_per_turn": best("engine_ms"),
        "prompt_tokens_per_turn": [t["prompt"] for t in first],
        "cached_tokens_per_turn": [t["cached"] for t in first],
        "turns": args.turns,
        "system_tokens": args.system_tokens,
        "reply_tokens": args.reply_tokens,
        "repeats": args.repeats,
        "engine_stats": engine.stats().to_dict(),
        **common.environment(args, model_dir),
    }
    common.emit("prefix", result)


if __name__ == "__main__":
    main()
