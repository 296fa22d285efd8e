"""Speculative decoding (runtime/speculation/): guesses change how fast tokens come, never which.

Greedy output with the ngram and draft-model drafters must equal plain decoding (and
transformers' ``generate()``) token for token in float32: alone, batched with requests that do
not speculate, after a prefix hit, over an int8 KV pool and in a pool small enough to preempt.
Rejected guesses must give their blocks back and never reach the prefix cache; sampling must
keep the distribution it draws from.
"""

import json
import math
from collections import Counter
from collections.abc import Sequence as SequenceOf
from pathlib import Path

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.engine.sequence import Sequence
from runtime.errors import DraftModelError
from runtime.speculation.adaptive import DraftLength, expected_tokens, plan_query
from runtime.speculation.ngram import NgramDrafter
from runtime.speculation.step_costs import MIN_STEPS, StepCosts
from runtime.speculation.verify import verify_greedy, verify_sampled
from tests.engine_helpers import PROMPTS, chat_ids, hf_greedy
from tests.tiny_models import make_tiny_model

NEW_TOKENS = 64
# Prompts whose replies repeat what they were given (where guessing pays), and one that does not.
SPEC_PROMPTS = [
    "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, "
    "grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya.",
    "Here is a function:\n\ndef total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n\n"
    "Rename s to acc and return the whole function.",
    PROMPTS[1],
]


def params(mode: str, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, speculate=mode, **kw)  # type: ignore[arg-type]


# -- the real default model, float32 --------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(default_model_path: Path) -> Engine:
    return Engine(default_model_path, kv_pool="64MiB", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompt_ids(engine: Engine) -> list[list[int]]:
    return [chat_ids(engine, p) for p in SPEC_PROMPTS]


@pytest.fixture(scope="module")
def reference(engine: Engine, prompt_ids: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(engine, ids, NEW_TOKENS, ignore_eos=True) for ids in prompt_ids]


@pytest.mark.model
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_greedy_tokens_equal_generate_alone_and_batched(engine: Engine, prompt_ids, reference, mode) -> None:
    engine.reset_prefix_cache()
    batched = engine.generate(prompt_ids, params(mode))
    assert [c.token_ids for c in batched] == reference
    engine.reset_prefix_cache()
    alone = engine.generate(prompt_ids[0], params(mode))[0]
    assert alone.token_ids == reference[0]
    # The guesses were really made and verified: the list is copied from the prompt.
    copied = alone.metrics
    assert copied.num_drafts > 0 and copied.num_accepted_tokens > copied.num_draft_tokens / 2
    assert copied.mean_accepted_length == pytest.approx(1 + copied.num_accepted_tokens / copied.num_drafts)
    assert copied.acceptance_rate == pytest.approx(copied.num_accepted_tokens / copied.num_draft_tokens)
    assert engine.stats().num_blocks_used == 0


@pytest.mark.model
def test_speculating_beside_plain_requests_and_after_a_prefix_hit(
    engine: Engine, prompt_ids, reference
) -> None:
    engine.reset_prefix_cache()
    mixed = engine.generate(prompt_ids, [params("ngram"), params("off"), params("draft")])
    assert [c.token_ids for c in mixed] == reference
    assert mixed[1].metrics.num_drafts == 0
    again = engine.generate(prompt_ids[1], params("ngram"))[0]
    assert again.metrics.num_cached_tokens > 0
    assert again.token_ids == reference[1]
    stats = engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


@pytest.mark.model
def test_int8_kv_pool_speculation_equals_plain(default_model_path: Path, prompt_ids) -> None:
    int8 = Engine(default_model_path, kv_pool="32MiB", dtype="float32", device="cpu", kv_dtype="int8")
    plain = [c.token_ids for c in int8.generate(prompt_ids, params("off"))]
    int8.reset_prefix_cache()
    guessed = int8.generate(prompt_ids, params("ngram"))
    assert [c.token_ids for c in guessed] == plain
    assert sum(c.metrics.num_accepted_tokens for c in guessed) > 0
    assert int8.stats().num_blocks_used == 0 and int8.kv_cache.num_open_blocks == 0


@pytest.mark.model
def test_preempting_pool_keeps_the_tokens(default_model_path: Path, prompt_ids, reference) -> None:
    bytes_per_block = 16 * 2 * 30 * 3 * 64 * 4  # 14 blocks: the three requests cannot all fit
    tight = Engine(default_model_path, kv_pool=14 * bytes_per_block, device="cpu", dtype="float32")
    completions = tight.generate(prompt_ids, params("ngram"))
    assert [c.token_ids for c in completions] == reference
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0
    assert stats.num_blocks_used == 0


@pytest.mark.model
def test_draft_model_with_another_vocabulary_is_one_line_error(
    default_model_path: Path, tmp_path: Path
) -> None:
    other = make_tiny_model("llama", tmp_path / "other-vocab", default_model_path)
    tokenizer_json = json.loads((other / "tokenizer.json").read_text())
    size = len(tokenizer_json["model"]["vocab"])
    tokenizer_json["added_tokens"].append(
        {"id": size, "content": "<liubai-only>", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
    )  # fmt: skip
    (other / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(DraftModelError) as error:
        Engine(default_model_path, kv_pool="16MiB", device="cpu", speculate="draft", draft_model=other,
               draft_weights="auto")  # fmt: skip
    message = str(error.value)
    assert "\n" not in message and "another vocabulary" in message


# -- rollback, on a tiny model ------------------------------------------------------------------


class WrongGuesses:
    """A drafter that guesses mostly wrong: the token after the last one, k times over."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, seqs: SequenceOf[Sequence], num_tokens: SequenceOf[int]) -> list[list[int]]:
        return [
            [(s.token_ids[-1] + 1 + i) % self.vocab_size for i in range(k)]
            for s, k in zip(seqs, num_tokens, strict=True)
        ]

    def forget(self, seq: Sequence) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        pass


def cache_contents(engine: Engine) -> dict[bytes, tuple[int, tuple[int, ...] | None]]:
    bm = engine.block_manager
    return {h: (b, bm.blocks[b].token_ids) for h, b in bm.cached_blocks.items()}


def test_rejected_guesses_leave_no_blocks_and_no_cached_guesses(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three guesses every step, whatever happened and whatever the steps cost (blocks of 4: most
    # steps cross into a new one).
    monkeypatch.setattr(DraftLength, "update", lambda self, drafted, accepted: None)
    monkeypatch.setattr("runtime.engine.engine.plan_query", lambda guesses, _a, _cost: 1 + max(guesses))

    def run(mode: str) -> tuple[Engine, list[int]]:
        engine = Engine(tiny_llama_path, kv_pool="4MiB", block_size=4, device="cpu", dtype="float32")
        engine._drafters["ngram"] = WrongGuesses(engine.model.config.vocab_size)
        out = engine.generate(
            [5, 6, 7, 8, 9, 10, 11],
            SamplingParams(max_tokens=41, ignore_eos=True, speculate=mode, num_draft_tokens=3),
        )
        return engine, out[0].token_ids

    plain, plain_tokens = run("off")
    guessed, guessed_tokens = run("ngram")
    assert guessed_tokens == plain_tokens
    stats = guessed.stats()
    assert stats.spec_num_draft_tokens - stats.spec_num_accepted_tokens > 100, "the guesses must mostly miss"
    assert stats.num_blocks_used == 0
    assert len(guessed.block_manager.free_queue) == guessed.block_manager.num_blocks
    # The same blocks hold the same verified tokens as after plain decoding, nothing more.
    assert cache_contents(guessed) == cache_contents(plain)
    tokens = [5, 6, 7, 8, 9, 10, 11, *plain_tokens]
    cached = sorted(cache_contents(guessed).values(), key=lambda v: v[0])
    assert [t for _, t in cached] == [tuple(tokens[i : i + 4]) for i in range(0, 4 * len(cached), 4)]


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    class Seq:
        def __init__(self, tokens: list[int]) -> None:
            self.token_ids = tokens

    drafter = NgramDrafter()
    seq = Seq([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    assert drafter.propose([seq], [3]) == [[4, 5, 6]]  # the latest "1 2 3" was followed by 4 5 6
    seq.token_ids.extend([4, 8, 1, 2])
    assert drafter.propose([seq], [2]) == [[3, 4]]  # the index grew with the new tokens
    assert drafter.propose([Seq([1, 2, 3, 4])], [5]) == [[]]  # no earlier occurrence: no guess
    # The longest match wins over a later, shorter one: "5 1 2 3" was followed by 7.
    assert drafter.propose([Seq([5, 1, 2, 3, 7, 9, 1, 2, 3, 8, 5, 1, 2, 3])], [1]) == [[7]]


def test_draft_length_grows_after_hits_and_shrinks_after_misses() -> None:
    length = DraftLength(8)
    assert length.current == 8
    length.update(8, 2)
    assert length.current == 3
    length.update(3, 3)
    assert length.current == 6
    length.update(6, 6)
    assert length.current == 8
    length.update(8, 0)
    assert length.current == 1


def test_acceptance_estimate_follows_recent_guesses() -> None:
    length = DraftLength(5)
    assert length.acceptance == pytest.approx(0.5)  # the prior, before any guess
    for _ in range(10):
        length.update(5, 5)  # every guess holds
    assert length.acceptance > 0.9
    for _ in range(20):
        length.update(1, 0)  # every guess misses
    assert length.acceptance < 0.1


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0


def test_plan_guesses_only_what_the_measured_step_repays() -> None:
    def costs(table: dict[int, float]):
        return lambda q: table.get(q)

    # Nothing measured: every length costs the same, so the longest wins (as without a plan).
    assert plan_query([5], [0.5], costs({})) == 6
    # Rows nearly free (a weight-bound step): guess all five.
    flat = {1: 10.0, 2: 10.5, 3: 11.0, 4: 11.0, 5: 12.0, 6: 12.0}
    assert plan_query([5], [0.8], costs(flat)) == 6
    # An AVX2 EPYC's compiled int4 step: 4 rows cost 1.33x one, 6 rows 2.3x (measured, code_edit).
    avx2 = {1: 22.0, 2: 23.6, 3: 29.1, 4: 29.1, 5: 50.3, 6: 50.3}
    assert plan_query([5], [0.8], costs(avx2)) == 4
    assert plan_query([5], [0.05], costs(avx2)) == 1  # guesses that rarely hold: none at all
    # An unmeasured length costs what the longest measured shorter one does, so it gets tried.
    assert plan_query([5], [0.8], costs({1: 22.0, 2: 23.6})) == 6
    # In a batch the step's length is one for all: a sequence that only decodes adds its token.
    assert plan_query([0, 5], [0.0, 0.9], costs(avx2)) == 4
    assert plan_query([0, 0], [0.0, 0.0], costs(avx2)) == 1


def test_step_costs_are_the_median_of_recent_steps() -> None:
    costs = StepCosts()
    for seconds in [0.02] * (MIN_STEPS - 1):
        costs.observe((1, 4), seconds)
    assert costs.estimate((1, 4)) is None  # too few steps to trust
    costs.observe((1, 4), 5.0)  # a neighbour's burst
    assert costs.estimate((1, 4)) == pytest.approx(0.02)
    assert costs.snapshot() == {"1x4": 20.0}


@pytest.mark.model
def test_no_guesses_where_the_measured_steps_do_not_repay_them(engine: Engine, prompt_ids, reference) -> None:
    """The copying prompt guesses well, but here a step with guesses costs 100 times one without."""
    engine.reset_prefix_cache()
    try:
        for _ in range(MIN_STEPS):
            engine.step_costs.observe((1, 1), 0.01)
            for query in range(2, 2 + engine.config.num_draft_tokens):
                engine.step_costs.observe((1, query), 1.0)
        out = engine.generate(prompt_ids[0], params("ngram"))[0]
        assert out.token_ids == reference[0]
        assert out.metrics.num_drafts == 0
    finally:
        engine.step_costs.clear()


# -- verification -------------------------------------------------------------------------------


def test_greedy_verification_keeps_the_longest_matching_prefix() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 1]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, [3, 5, 7]) == [3, 5, 7, 1]  # all held: the bonus token follows
    assert verify_greedy(logits, [3, 4, 7]) == [3, 5]  # the correction replaces the first miss
    assert verify_greedy(logits[:1], []) == [3]


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile by Wilson and Hilferty's approximation; z = 3.09 is the normal's
    0.999 quantile, so a correct sampler fails one seed in a thousand (the seeds are fixed, so a
    pass stays a pass), while a sampler that ignores rejection shifts the counts by far more."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_rejection_sampling_draws_from_the_models_distribution() -> None:
    """Over 20,000 draws, the first emitted token (a guess accepted, or the correction) and the
    bonus token after an accepted guess follow the model's probabilities."""
    torch.manual_seed(0)
    logits = torch.randn(2, 8) * 1.5
    p = SamplingParams(temperature=0.8, seed=1)
    generator = torch.Generator().manual_seed(1)
    guess = int(logits[0].topk(2).indices[1])  # the runner-up: often rejected, often accepted
    draws = 20_000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(draws):
        out = verify_sampled(logits, [guess], p, generator)
        first[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
    for counts, row in ((first, 0), (second, 1)):
        expected = (logits[row] / 0.8).softmax(-1) * sum(counts.values())
        stat = sum((counts[v] - float(e)) ** 2 / float(e) for v, e in enumerate(expected))
        assert stat < chi_square_critical(7), (row, stat)
    assert 0 < sum(second.values()) < draws  # both outcomes happened


class FrequentGuesses:
    """Guesses, for output position j, the token plain sampling drew most often there."""

    def __init__(self, table: dict[int, int]) -> None:
        self.table = table

    def propose(self, seqs: SequenceOf[Sequence], num_tokens: SequenceOf[int]) -> list[list[int]]:
        guesses = []
        for seq, k in zip(seqs, num_tokens, strict=True):
            start = seq.num_output_tokens
            guesses.append([self.table[j] for j in range(start, start + k) if j in self.table])
        return guesses

    def forget(self, seq: Sequence) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        pass


def test_speculative_sampling_matches_plain_sampling_on_a_tiny_model(
    default_model_path: Path, tmp_path: Path
) -> None:
    """Two samples of 240 seeded requests each (other seeds on each side), with and without
    guesses: the tokens at output positions 1-3, where accepted guesses, corrections and bonus
    tokens stand, come from one distribution (two-sample chi-square over the (position, token)
    pairs seen at least 10 times, the rest pooled into one)."""
    tiny = make_tiny_model("llama", tmp_path / "tiny-sampling", default_model_path, seed=3)
    n = 240
    engine = Engine(tiny, kv_pool="16MiB", device="cpu", dtype="float32", max_num_seqs=n,
                    speculate_max_batch=n)  # fmt: skip
    prompt = [11, 12, 13, 14, 15, 16]

    def draw(mode: str, seeds: range) -> list[list[int]]:
        one = dict(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True, speculate=mode)
        many = [SamplingParams(seed=s, **one) for s in seeds]  # type: ignore[arg-type]
        return [c.token_ids for c in engine.generate([prompt] * n, many)]

    plain = draw("off", range(n))
    table = {j: Counter(t[j] for t in plain).most_common(1)[0][0] for j in range(1, 4)}
    engine._drafters["ngram"] = FrequentGuesses(table)
    guessed = draw("ngram", range(n, 2 * n))
    stats = engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, "guesses must hold and miss"
    counts = [Counter((j, t[j]) for t in sample for j in range(1, 4)) for sample in (plain, guessed)]
    keys = set(counts[0]) | set(counts[1])
    common = [k for k in keys if counts[0][k] + counts[1][k] >= 10]
    pairs = [(counts[0][k], counts[1][k]) for k in common]
    pairs.append(tuple(sum(c[k] for k in keys if k not in common) for c in counts))  # type: ignore[arg-type]
    stat = sum((a - b) ** 2 / (a + b) for a, b in pairs if a + b)
    assert len(common) >= 4, "too few tokens seen often to compare"
    assert stat < chi_square_critical(len(pairs) - 1), (stat, len(pairs))


class AlwaysGuesses(FrequentGuesses):
    """Guesses token 0 at every position: every decoding sequence drafts whenever it may."""

    def __init__(self) -> None:
        super().__init__({})

    def propose(self, seqs: SequenceOf[Sequence], num_tokens: SequenceOf[int]) -> list[list[int]]:
        return [[0] * k for k in num_tokens]


@pytest.mark.parametrize(("weights", "bound"), [("float32", 4), ("int4", 4), ("int8", None)])
def test_auto_speculation_guesses_up_to_the_formats_measured_batch(
    weights: str, bound: int | None, tiny_llama_path: Path
) -> None:
    """``speculate="auto"`` is prompt lookup where bench.spec measured it never costing over 5%:
    up to 4 running requests, eager or compiled, in float32 or int4; int8 was not measured and
    does not guess."""
    engine = Engine(tiny_llama_path, kv_pool="8MiB", device="cpu", weights=weights)
    assert engine.speculate == ("off" if bound is None else "ngram")
    if bound is None:
        return
    engine._drafters["ngram"] = AlwaysGuesses()
    one = SamplingParams(max_tokens=6, ignore_eos=True)
    for n in (bound, bound + 1):
        before = engine.stats().spec_num_drafts
        engine.generate([[5, 6, 7, 8 + i] for i in range(n)], one)
        assert (engine.stats().spec_num_drafts > before) == (n == bound), n
    explicit = Engine(tiny_llama_path, kv_pool="8MiB", device="cpu", weights=weights, speculate_max_batch=8)
    assert explicit.config.speculate_max_batch == 8
    compiled = Engine(tiny_llama_path, kv_pool="8MiB", device="cpu", weights=weights, compile=True)
    assert compiled.config.speculate_max_batch == 4
