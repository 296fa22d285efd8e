"""Shared pieces of the engine tests: reference generation with transformers itself."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from runtime import Engine, SamplingParams

# Chat prompts of different lengths whose replies run past 64 tokens, shared by the
# default-model tests so the engine and the quantized cache are checked on the same text.
PROMPTS = [
    "Write a long story about a lighthouse keeper who collects seashells.",
    "Explain in detail how a bicycle works, part by part.",
    "Describe the water cycle to a ten year old, with many examples.",
]
NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@contextmanager
def transformers_attention(engine: Engine) -> Iterator[None]:
    """Run the engine's own model weights through transformers' SDPA path for a reference."""
    config = engine.model.config
    saved = config._attn_implementation
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = saved


def hf_greedy(
    engine: Engine, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False
) -> list[int]:
    """transformers' ``generate()``: greedy, stopping at EOS like the engine does unless told not to
    (then it runs the full ``max_new_tokens``, like ``SamplingParams(ignore_eos=True)``)."""
    generation_config = engine.model.generation_config
    saved_eos = generation_config.eos_token_id
    if ignore_eos:
        generation_config.eos_token_id = None
    try:
        with transformers_attention(engine), torch.inference_mode():
            out = engine.model.generate(
                torch.tensor([prompt_ids], device=engine.device),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=engine.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None if ignore_eos else engine.eos_token_ids,
                pad_token_id=engine.eos_token_ids[0],
            )
    finally:
        generation_config.eos_token_id = saved_eos
    return out[0, len(prompt_ids) :].tolist()


def chat_ids(engine: Engine, user: str, system: str | None = None) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    encoded = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])
