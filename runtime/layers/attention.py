"""The attention function the engine registers with transformers.

The engine runs the model with ``use_cache=False`` on all scheduled tokens packed into one
``(1, T)`` sequence. transformers computes projections, RoPE and MLPs; for attention it calls
:func:`paged_attention_forward`, which receives this step's :class:`AttentionMetadata` through the
forward's keyword arguments. The function writes the step's keys and values into the KV pool,
then attends each sequence over its own context:

- a prefill span with no cached context attends over its own fresh keys (causal), exactly the
  computation ``generate()`` performs on a prompt;
- a prefill span that continues cached context (prefix hit, chunked prefill, recompute) gathers
  its context from the pool and uses an explicit causal mask offset by the cached length;
- decode tokens (one per sequence) gather their contexts into one padded batch.

A quantized cache replaces the first two cases' reads (``KVCache.read_span``/``read_decode``):
each token attends to its earlier blocks dequantized and to its own block in full precision,
with a mask the cache builds; only the blocks of the contexts being read are dequantized.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from runtime.kv.cache import KVCache

ATTENTION_NAME = "liubai_paged"
METADATA_KWARG = "liubai_attn_metadata"


@dataclass(slots=True)
class PrefillSpan:
    query_start: int
    query_end: int
    context_slots: torch.Tensor | None  # (L,) when earlier context is in the pool, else None
    mask: torch.Tensor | None  # (q, L) bool, True where attention is allowed


@dataclass(slots=True)
class DecodeBatch:
    query_index: torch.Tensor  # (B,) positions of the decode tokens in the packed step
    context_slots: torch.Tensor  # (B, L_max), padded with slot 0
    mask: torch.Tensor | None  # (B, 1, 1, L_max) bool; None when all contexts have one length


@dataclass(slots=True)
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # (T,) where each packed token's K/V goes
    prefills: list[PrefillSpan]
    decode: DecodeBatch | None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, T, D)
    key: torch.Tensor,  # (1, KVH, T, D)
    value: torch.Tensor,  # (1, KVH, T, D)
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata = kwargs[METADATA_KWARG]
    layer: int = module.layer_idx  # type: ignore[assignment]
    cache = meta.kv_cache
    cache.write(layer, meta.slot_mapping, key[0], value[0])

    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    out = query.new_empty(num_tokens, num_heads, head_dim)  # (T, H, D)

    for span in meta.prefills:
        s, e = span.query_start, span.query_end
        q = query[:, :, s:e]  # (1, H, q, D)
        if cache.quantized:
            # Earlier blocks as stored, the span's own blocks exact (kv_context.py), for
            # cached and fresh spans alike: a token's numbers never depend on scheduling.
            slots = span.context_slots if span.context_slots is not None else meta.slot_mapping[s:e]
            k, v, mask = cache.read_span(layer, s, slots, key[0, :, s:e], value[0, :, s:e])  # (KVH, L', D)
            o = F.scaled_dot_product_attention(
                q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scaling, enable_gqa=True
            )
        elif span.context_slots is None:
            k, v = key[:, :, s:e], value[:, :, s:e]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=e - s > 1, scale=scaling, enable_gqa=True)
        else:
            k, v = cache.gather(layer, span.context_slots)  # (KVH, L, D)
            o = F.scaled_dot_product_attention(
                q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=span.mask, scale=scaling, enable_gqa=True
            )
        out[s:e] = o[0].transpose(0, 1)

    decode = meta.decode
    if decode is not None:
        batch = decode.context_slots.shape[0]
        q = query[0, :, decode.query_index].transpose(0, 1)  # (B, H, D)
        decode_mask: torch.Tensor | None
        if cache.quantized:
            k, v, decode_mask = cache.read_decode(layer, decode.context_slots, decode.mask)  # (B, KVH, L', D)
        else:
            k, v = cache.gather_batch(layer, decode.context_slots)  # (B, KVH, L, D) each
            decode_mask = decode.mask
        num_kv_heads = k.shape[1]
        if decode_mask is None:
            o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scaling, enable_gqa=True)
            out[decode.query_index] = o.squeeze(2)
        else:
            # One query token per sequence: fold the query heads that share a KV head into the
            # query-length axis, so GQA needs no repeated keys and the mask stays per sequence.
            groups = num_heads // num_kv_heads
            q = q.reshape(batch, num_kv_heads, groups, head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=decode_mask, scale=scaling)
            out[decode.query_index] = o.reshape(batch, num_heads, head_dim)

    return out.unsqueeze(0), None
