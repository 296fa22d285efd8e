"""Logits at every position of a token sequence, from the engine's own forward.

Judging a weight format (KL divergence, top-1 agreement and perplexity against the stored
weights) needs the distribution at every position of a held text, not only at the sampled
one. :func:`prompt_logits` runs the text as one prefill through the engine's model runner, so
it scores exactly the forward the engine decodes with. The prefill writes its keys and values
into the pool's first blocks without the block manager, so it runs only on an idle engine and
afterwards forgets the prefix cache those writes made stale.
"""

from typing import TYPE_CHECKING

import torch

from runtime.layers.attention import AttentionMetadata, PrefillSpan

if TYPE_CHECKING:
    from runtime.engine.engine import Engine


@torch.inference_mode()
def prompt_logits(engine: "Engine", token_ids: list[int]) -> torch.Tensor:
    """Float32 logits (T, V): row i is the distribution of token i + 1 given tokens 0..i."""
    stats = engine.stats()
    if stats.num_running or stats.num_waiting:
        raise RuntimeError("prompt_logits needs an idle engine: it writes KV outside the block manager")
    if engine.kv_cache.layout.quantized:
        raise ValueError("prompt_logits needs KV stored in the model dtype (kv_dtype='auto')")
    num_tokens = len(token_ids)
    if num_tokens > engine.pool_capacity_tokens:
        raise ValueError(f"{num_tokens} tokens do not fit the KV pool ({engine.pool_capacity_tokens} tokens)")
    device = engine.device
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        kv_cache=engine.kv_cache,
        slot_mapping=positions,  # the pool's first slots, in order
        prefills=[PrefillSpan(0, num_tokens, None, None)],
        decode=None,
    )
    ids = torch.tensor(token_ids, device=device)
    with engine._step_lock:
        logits = engine.runner.forward(ids, positions, meta, positions)  # (T, V)
    engine.reset_prefix_cache()
    return logits.float()
