"""The engine on a tiny random Qwen2 (attention with q/k/v bias), against generate()."""

from pathlib import Path

import pytest
import torch

from runtime import Engine, SamplingParams
from tests.engine_helpers import hf_greedy


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_path: Path) -> Engine:
    return Engine(tiny_qwen2_path, kv_pool="4MiB", block_size=16, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def qwen2_via_transformers(tiny_qwen2_path: Path) -> Engine:
    """The same model through transformers' own modules and the attention hook only."""
    return Engine(tiny_qwen2_path, kv_pool="4MiB", block_size=16, device="cpu", forward="transformers")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 37, 80)]


@pytest.mark.parametrize("path", ["lean", "transformers"])
def test_greedy_equals_generate_and_batching_changes_nothing(
    path: str, qwen2: Engine, qwen2_via_transformers: Engine
) -> None:
    if path == "transformers":
        qwen2 = qwen2_via_transformers
    assert (qwen2.runner.lean_forward is None) == (path == "transformers")
    assert qwen2.model.config.model_type == "qwen2"
    assert qwen2.model.model.layers[0].self_attn.q_proj.bias is not None
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    reference = [hf_greedy(qwen2, p, 64, ignore_eos=True) for p in prompts()]
    alone = [qwen2.generate(p, params)[0].token_ids for p in prompts()]
    together = [c.token_ids for c in qwen2.generate(prompts(), params)]
    assert alone == reference
    assert together == reference
    assert all(len(r) == 64 for r in reference)


def test_seeded_sampling_is_reproducible_and_batch_independent(qwen2: Engine) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    first = qwen2.generate(prompts()[1], params)[0].token_ids
    again = qwen2.generate(prompts()[1], params)[0].token_ids
    mixed = qwen2.generate(
        prompts(),
        [
            SamplingParams(max_tokens=20, ignore_eos=True),
            params,
            SamplingParams(max_tokens=5, temperature=1.0, seed=3),
        ],
    )
    assert first == again == mixed[1].token_ids
    other_seed = qwen2.generate(
        prompts()[1], SamplingParams(max_tokens=20, temperature=0.8, seed=8, ignore_eos=True)
    )[0].token_ids
    assert other_seed != first


def test_top_k_one_is_greedy(qwen2: Engine) -> None:
    greedy = qwen2.generate(prompts()[0], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    top1 = qwen2.generate(
        prompts()[0], SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=1, ignore_eos=True)
    )[0].token_ids
    assert top1 == greedy


def test_stop_token_ids_end_the_reply_and_are_kept(qwen2: Engine) -> None:
    greedy = qwen2.generate(prompts()[0], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    stop_at = greedy[5]
    result = qwen2.generate(
        prompts()[0], SamplingParams(max_tokens=16, stop_token_ids=[stop_at], ignore_eos=True)
    )[0]
    assert result.finish_reason == "stop"
    assert result.token_ids == greedy[: greedy.index(stop_at) + 1]


def test_prompt_errors_are_clear(qwen2: Engine) -> None:
    from runtime import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="context is 2048"):
        qwen2.generate(list(range(3, 2100)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        qwen2.generate("", SamplingParams(max_tokens=1))


def test_pool_errors_are_clear(tiny_qwen2_path: Path) -> None:
    from runtime import PoolTooSmallError, PromptTooLongError

    with pytest.raises(PoolTooSmallError, match="cannot hold one block"):
        Engine(tiny_qwen2_path, kv_pool="1KiB", device="cpu", dtype="float32")
    # K and V x 2 layers x 2 KV heads x 16 dims x 4 bytes (float32) = 512 B/token: 64 tokens in 32 KiB
    small = Engine(tiny_qwen2_path, kv_pool="32KiB", device="cpu", dtype="float32")
    assert small.pool_capacity_tokens == 64
    with pytest.raises(PromptTooLongError, match="KV pool holds 64"):
        small.generate(list(range(3, 100)), SamplingParams(max_tokens=1))
    result = small.generate(list(range(3, 40)), SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert result.finish_reason == "length" and len(result.token_ids) == 65 - 37


def test_a_last_prompt_token_computed_alone_is_counted_as_prefilled(
    qwen2: Engine, tiny_qwen2_path: Path
) -> None:
    """Regression: ``Sequence.is_prefill`` turned false as soon as only the last prompt token
    lacked KV, so a step computing that token alone (after a block-aligned cached prefix, or as a
    one-token last chunk) was counted as a decode step, and ``num_prefilled_tokens``, with the
    prefill speed, cost and logs built on it, came out one short."""
    ids = prompts()[2][:33]  # two full blocks of 16, and one token
    qwen2.reset_prefix_cache()
    cold = qwen2.generate(ids, SamplingParams(max_tokens=1))[0]
    assert (cold.metrics.num_cached_tokens, cold.metrics.num_prefilled_tokens) == (0, 33)
    warm = qwen2.generate(ids, SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert (warm.metrics.num_cached_tokens, warm.metrics.num_prefilled_tokens) == (32, 1)

    chunked = Engine(
        tiny_qwen2_path,
        kv_pool="4MiB",
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        device="cpu",
        dtype="float32",
    )
    for n in (17, 33):  # chunks of 16 + 1 and 16 + 16 + 1
        result = chunked.generate(ids[:n], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert (result.metrics.num_cached_tokens, result.metrics.num_prefilled_tokens) == (0, n)
