"""End to end on the real default model (SmolLM2-135M-Instruct): the engine must reproduce
transformers' own ``generate()`` token for token, alone, batched, chunked, preempted and with
its prefix cache."""

from pathlib import Path

import pytest

from runtime import Engine, SamplingParams
from tests.engine_helpers import GREEDY, NEW_TOKENS, PROMPTS, chat_ids, hf_greedy

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(default_model_path: Path) -> Engine:
    return Engine(default_model_path, kv_pool="64MiB", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompt_ids(engine: Engine) -> list[list[int]]:
    return [chat_ids(engine, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(engine: Engine, prompt_ids: list[list[int]]) -> list[list[int]]:
    """generate()'s greedy tokens, run past EOS so that every comparison covers 64 tokens."""
    return [hf_greedy(engine, ids, NEW_TOKENS, ignore_eos=True) for ids in prompt_ids]


def test_greedy_equals_transformers_generate(engine: Engine, prompt_ids, reference) -> None:
    assert len({len(ids) for ids in prompt_ids}) == len(prompt_ids), "prompts must differ in length"
    for ids, ref in zip(prompt_ids, reference, strict=True):
        engine.reset_prefix_cache()
        completion = engine.generate(ids, GREEDY)[0]
        assert completion.token_ids == ref
        assert completion.finish_reason == "length"
        assert completion.text == engine.tokenizer.decode(ref, skip_special_tokens=True)


def test_transformers_forward_path_also_equals_generate(
    default_model_path: Path, prompt_ids, reference
) -> None:
    """The attention hook alone (no lean forward) is the route for every other architecture."""
    hook_only = Engine(default_model_path, kv_pool="16MiB", device="cpu", forward="transformers")
    assert hook_only.runner.lean_forward is None
    assert hook_only.generate(prompt_ids[2], GREEDY)[0].token_ids == reference[2]


def test_reply_stops_at_eos_like_generate(engine: Engine, prompt_ids) -> None:
    ref = hf_greedy(engine, prompt_ids[1], NEW_TOKENS)
    completion = engine.generate(prompt_ids[1], SamplingParams(max_tokens=NEW_TOKENS))[0]
    assert completion.token_ids == ref
    assert ref[-1] in engine.eos_token_ids and completion.finish_reason == "stop"
    assert not completion.text.endswith("<|im_end|>")


def test_batch_of_different_lengths_equals_each_alone(engine: Engine, prompt_ids, reference) -> None:
    engine.reset_prefix_cache()
    completions = engine.generate(prompt_ids, GREEDY)
    assert [c.token_ids for c in completions] == reference
    assert engine.stats().max_batch_size >= len(prompt_ids)


def test_chunked_prefill_gives_the_same_tokens(default_model_path: Path, prompt_ids, reference) -> None:
    small_steps = Engine(
        default_model_path, kv_pool="64MiB", max_num_batched_tokens=16, device="cpu", dtype="float32"
    )
    completions = small_steps.generate(prompt_ids[:2], GREEDY)
    assert [c.token_ids for c in completions] == reference[:2]
    for c, ids in zip(completions, prompt_ids, strict=False):
        assert c.metrics.num_prefilled_tokens + c.metrics.num_cached_tokens == len(ids)


def test_prefix_cache_prefills_only_the_uncached_tokens(engine: Engine) -> None:
    system = "You are a careful assistant for a library. " * 30  # a long shared prefix
    first = chat_ids(engine, "Which books are about the sea?", system=system)
    second = chat_ids(engine, "Recommend a novel about mountains, please.", system=system)
    engine.reset_prefix_cache()
    cold = hf_greedy(engine, second, 32)

    engine.generate(first, SamplingParams(max_tokens=8))
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    expected_cached = common // 16 * 16
    assert expected_cached >= 160
    result = engine.generate(second, SamplingParams(max_tokens=32))[0]
    assert result.metrics.num_cached_tokens == expected_cached
    assert result.metrics.num_prefilled_tokens == len(second) - expected_cached
    assert result.token_ids == cold


def test_identical_prompt_recomputes_exactly_one_token_block(engine: Engine, prompt_ids) -> None:
    ids = (prompt_ids[0] + prompt_ids[1])[:48]  # three full blocks: the last token must still run
    engine.reset_prefix_cache()
    engine.generate(ids, SamplingParams(max_tokens=2))
    again = engine.generate(ids, SamplingParams(max_tokens=2))[0]
    assert again.metrics.num_cached_tokens == 32
    assert again.metrics.num_prefilled_tokens == 16


def test_preemption_under_a_small_pool_keeps_the_tokens(
    default_model_path: Path, prompt_ids, reference
) -> None:
    # 14 blocks of 16 tokens: each request needs ~7 blocks, so three cannot all run at once.
    bytes_per_block = 16 * 2 * 30 * 3 * 64 * 4
    tight = Engine(default_model_path, kv_pool=14 * bytes_per_block, device="cpu", dtype="float32")
    assert tight.stats().num_blocks_total == 14
    completions = tight.generate(prompt_ids, GREEDY)
    assert [c.token_ids for c in completions] == reference
    stats = tight.stats()
    assert stats.num_preemptions > 0
    assert sum(c.metrics.num_preemptions for c in completions) == stats.num_preemptions
    assert stats.num_blocks_used == 0, "a finished run must not leak blocks"


def test_stream_deltas_add_up_to_the_completion(engine: Engine, prompt_ids) -> None:
    params = SamplingParams(max_tokens=24)
    whole = engine.generate(prompt_ids[1], params)[0]
    deltas = list(engine.stream(prompt_ids[1], params))
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    assert deltas[-1].finished and deltas[-1].metrics is not None
    assert all(d.metrics is None for d in deltas[:-1])
    metrics = deltas[-1].metrics
    assert metrics.num_generated_tokens == 24
    assert len(metrics.inter_token_ms) == 23
    assert metrics.ttft_ms >= metrics.prefill_ms > 0


def test_stop_string_ends_the_reply_before_it(engine: Engine, prompt_ids, reference) -> None:
    full_text = engine.tokenizer.decode(reference[0], skip_special_tokens=True)
    words = full_text.split()
    stop = words[len(words) // 2]
    result = engine.generate(
        prompt_ids[0], SamplingParams(max_tokens=NEW_TOKENS, stop=[stop], ignore_eos=True)
    )[0]
    assert result.finish_reason == "stop"
    assert result.text == full_text[: full_text.index(stop)]
    streamed = "".join(
        d.text
        for d in engine.stream(prompt_ids[0], SamplingParams(max_tokens=64, stop=[stop], ignore_eos=True))
    )
    assert streamed == result.text


def test_all_blocks_return_after_requests_finish(default_model_path: Path) -> None:
    """On an engine of its own that runs its own requests, so it holds alone and in any order
    (on the shared engine it only checked what earlier tests happened to leave)."""
    own = Engine(default_model_path, kv_pool="16MiB", dtype="float32", device="cpu")
    ids = [chat_ids(own, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    own.generate(ids, params)
    abandoned = own.stream(ids[0], params)
    next(abandoned)
    next(abandoned)
    assert own.stats().num_blocks_used > 0 and own.stats().num_running == 1
    abandoned.close()  # the request is aborted
    stats = own.stats()
    assert stats.num_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    assert stats.num_blocks_cached > 0, "finished requests' full blocks stay in the prefix cache"
    assert stats.num_blocks_cached + stats.num_blocks_free == stats.num_blocks_total
    assert stats.kv_tokens_in_use == 0
    assert stats.bytes_per_token == 2 * 30 * 3 * 64 * 4


def test_unused_allocation_is_at_most_one_partial_block_per_sequence(engine: Engine, prompt_ids) -> None:
    block_size = engine.config.block_size
    streams = [engine.stream(ids, SamplingParams(max_tokens=20, ignore_eos=True)) for ids in prompt_ids[:2]]
    seen = 0
    for _ in range(15):  # stop before the last token: a finished stream holds no blocks
        for stream in streams:
            next(stream)
        stats = engine.stats()
        # kv_bytes_in_use counts whole blocks; the tokens in them fall short by less than a block each.
        slack_tokens = stats.kv_bytes_in_use // stats.bytes_per_token - stats.kv_tokens_in_use
        assert 0 <= slack_tokens < stats.num_running * block_size
        seen += 1
    for stream in streams:
        for _ in stream:
            pass
    assert seen == 15 and engine.stats().num_blocks_used == 0
