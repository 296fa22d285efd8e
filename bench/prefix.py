"""Prefix caching across a multi-turn chat: liubai's prefix cache against transformers keeping its own.

A conversation opens with a ~1,000-token system prompt (a made-up policy document, built
offline from a seed) and runs ``--turns`` turns. Each turn appends a user question, sends the
whole history through the chat template, and appends the model's greedy reply (at most
``--reply-tokens`` tokens, ending at EOS). liubai streams the turn on one engine, so every
turn after the first should find the history in its prefix cache and prefill only the new
tail; its wall-clock TTFT is the time to its first streamed delta. The replies in the history
are liubai's, so every side sees identical prompts.

Two transformers sides get the same ids, each timed as a 1-token ``generate()``:

- kept cache, what a careful user of transformers runs: one ``DynamicCache`` per conversation,
  kept across turns. Each turn crops it to the longest prefix its tokens share with the new
  prompt (at least the last prompt token is always computed) and calls ``generate()`` with the
  full ids and the cache, which then computes only the tail. After the timed call the cache
  takes in the turn's reply as liubai's token ids, all but the last, which is exactly what
  generating that reply would have left in it; the chat template's re-encoding of the reply
  and the turn's closing tokens are then whatever the next crop finds them to be.
- re-sending: the whole history recomputed every turn (no cache), the reading this benchmark
  reported before; it measures a cache against no cache.

The three sides take turns in a rotating order, so no side always runs first. The
conversation runs ``--repeats`` times with different documents (no cross-conversation hits)
and each turn keeps its best TTFT per side. ``hit_rate`` is cached / prompt tokens over turns
2..N from the engine's metrics. ``ttft_ratio_vs_reused_cache`` is liubai / kept cache at turn
6 (the last turn when there are fewer; ``ratio_turn`` says which), ``ttft_ratio_vs_resending``
liubai / re-sending at the same turn. ``first_token_agreement`` is the share of turns whose
kept-cache first token equals the re-sending one: the check that the kept cache is used
correctly.
"""

import argparse
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from bench import common

RATIO_TURN = 6
TARGETS = {"ttft_ratio_vs_reused_cache": 1.0}  # at most
SIDES = ("liubai", "hf_kept", "hf_resend")
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


# --- liubai ----------------------------------------------------------------------------------


@dataclass(slots=True)
class LiubaiTurn:
    ttft_ms: float
    metrics: Any
    text: str
    token_ids: list[int]


def liubai_turn(engine: Any, ids: list[int], max_tokens: int) -> LiubaiTurn:
    """Wall-clock TTFT (ms), the engine's metrics, the reply's text and token ids of one streamed turn."""
    texts: list[str] = []
    token_ids: list[int] = []
    first_ms, metrics = 0.0, None
    start = common.now()
    for delta in engine.stream(ids, common.sampling(max_tokens, ignore_eos=False)):
        first_ms = first_ms or (common.now() - start) * 1000
        texts.append(delta.text)
        token_ids.extend(delta.token_ids)
        metrics = delta.metrics or metrics
    return LiubaiTurn(first_ms, metrics, "".join(texts), token_ids)


# --- transformers keeping its own cache ------------------------------------------------------


@dataclass(slots=True)
class KeptCache:
    """One conversation's ``DynamicCache`` and the token ids whose states it holds."""

    cache: Any
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, model: Any) -> "KeptCache":
        from transformers import DynamicCache

        return cls(DynamicCache(config=model.config))

    def reuse(self, ids: list[int]) -> int:
        """Crop to the longest prefix shared with ``ids`` (one token short of all of them); its length."""
        shared = 0
        for a, b in zip(self.token_ids, ids[:-1], strict=False):
            if a != b:
                break
            shared += 1
        excess = self.cache.get_seq_length() - shared
        if excess > 0:
            self.cache.crop(-excess)  # negative: remove that many from the end (old and new API)
        self.token_ids = self.token_ids[:shared]
        return shared

    def first_token(self, model: Any, ids: list[int]) -> int:
        """``generate()`` one token from the full ``ids``; the cache computes only what it lacks."""
        token = common.hf_generate(model, ids, 1, **{common.cache_kwarg(model): self.cache})
        self.token_ids = list(ids)
        if (held := self.cache.get_seq_length()) != len(ids):
            raise RuntimeError(f"the kept cache holds {held} tokens, expected {len(ids)}")
        return int(token[0, 0])

    def take_reply(self, model: Any, reply_ids: list[int]) -> None:
        """What ``generate()`` of this reply leaves in the cache: every reply token but the last."""
        if len(reply_ids) < 2:
            return
        with torch.inference_mode():
            model(torch.tensor([reply_ids[:-1]]), use_cache=True, **{common.cache_kwarg(model): self.cache})
        self.token_ids.extend(reply_ids[:-1])


# --- one conversation ------------------------------------------------------------------------


def conversation(engine: Any, hf_model: Any, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """One conversation; per turn the three TTFTs, liubai's token accounting and the kept cache's."""
    tokenizer = engine.tokenizer
    history = [{"role": "system", "content": policy_document(tokenizer, seed, args.system_tokens)}]
    kept = KeptCache.create(hf_model)
    turns = []
    for turn, question in enumerate(_QUESTIONS[: args.turns], start=1):
        history.append({"role": "user", "content": question})
        ids = common.chat_ids(tokenizer, history)
        shared = kept.reuse(ids)
        row: dict[str, Any] = {"hf_kept_prefilled": len(ids) - shared}
        start = (turn + seed) % len(SIDES)
        order = SIDES[start:] + SIDES[:start]
        for side in order:
            if side == "liubai":
                reply = liubai_turn(engine, ids, args.reply_tokens)
                row["liubai_ms"] = reply.ttft_ms
            elif side == "hf_kept":
                token, seconds = common.timed(kept.first_token, hf_model, ids)
                row["hf_kept_ms"], row["hf_kept_token"] = seconds * 1000, token
            else:
                out, seconds = common.timed(common.hf_generate, hf_model, ids, 1)
                row["hf_resend_ms"], row["hf_resend_token"] = seconds * 1000, int(out[0, 0])
        kept.take_reply(hf_model, reply.token_ids)
        history.append({"role": "assistant", "content": reply.text})
        metrics = reply.metrics
        row.update(
            prompt=metrics.num_prompt_tokens,
            cached=metrics.num_cached_tokens,
            prefilled=metrics.num_prefilled_tokens,
            engine_ms=metrics.ttft_ms,
            liubai_token=reply.token_ids[0],
        )
        turns.append(row)
        common.log(
            f"seed {seed} turn {turn} ({', '.join(order)}): {len(ids)} prompt tokens, "
            f"liubai {metrics.num_cached_tokens} cached, kept cache {shared}; ttft liubai "
            f"{row['liubai_ms']:.0f} ms, kept cache {row['hf_kept_ms']:.0f} ms, "
            f"re-sending {row['hf_resend_ms']:.0f} ms"
        )
    return turns


def warm_up(engine: Any, hf_model: Any) -> None:
    """Every path once: liubai's stream and a prefix hit, transformers with and without a kept cache."""
    warm = common.chat_prompt(engine.tokenizer, 9999, 64)
    engine.generate([warm], common.sampling(4))
    common.hf_generate(hf_model, warm, 4)
    kept = KeptCache.create(hf_model)
    kept.first_token(hf_model, warm[:-16])
    kept.reuse(warm)
    kept.first_token(hf_model, warm)


def main() -> None:
    args = parse_args()
    model_dir = common.resolve_model_dir(args.model)
    engine = common.make_engine(model_dir, args.dtype)
    hf_model = common.load_hf(model_dir, args.dtype)
    warm_up(engine, hf_model)

    runs = [conversation(engine, hf_model, args, seed) for seed in range(1, args.repeats + 1)]
    first = runs[0]

    def best(key: str) -> list[float]:
        return [round(min(run[t][key] for run in runs), 1) for t in range(args.turns)]

    later = [turn for run in runs for turn in run[1:]]
    every = [turn for run in runs for turn in run]
    liubai_ms, kept_ms, resend_ms = best("liubai_ms"), best("hf_kept_ms"), best("hf_resend_ms")
    at = min(RATIO_TURN, args.turns) - 1
    vs_kept = common.ratio(liubai_ms[at], kept_ms[at])
    result: dict[str, Any] = {
        "ttft_ratio_vs_reused_cache": vs_kept,
        "ttft_ratio_vs_resending": common.ratio(liubai_ms[at], resend_ms[at]),
        "ratio_turn": at + 1,
        "hit_rate": round(sum(t["cached"] for t in later) / sum(t["prompt"] for t in later), 3),
        "liubai_ttft_ms_per_turn": liubai_ms,
        "hf_kept_cache_ttft_ms_per_turn": kept_ms,
        "hf_resend_ttft_ms_per_turn": resend_ms,
        "liubai_engine_ttft_ms_per_turn": best("engine_ms"),
        "prompt_tokens_per_turn": [t["prompt"] for t in first],
        "cached_tokens_per_turn": [t["cached"] for t in first],
        "prefill_tokens_per_turn": [t["prefilled"] for t in first],
        "hf_kept_cache_prefill_tokens_per_turn": [t["hf_kept_prefilled"] for t in first],
        "first_token_agreement": {
            "kept_cache_vs_resending": round(
                sum(t["hf_kept_token"] == t["hf_resend_token"] for t in every) / len(every), 3
            ),
            "liubai_vs_resending": round(
                sum(t["liubai_token"] == t["hf_resend_token"] for t in every) / len(every), 3
            ),
        },
        "targets": TARGETS,
        "meets_targets": {"ttft_ratio_vs_reused_cache": vs_kept is not None and vs_kept <= 1.0},
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
