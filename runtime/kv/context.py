"""What a token attends to in a quantized cache: earlier blocks quantized, its own block exact.

Every token at position p, in block j = p // block_size, attends to blocks 0..j-1 as stored
(quantized) and to the tokens of block j up to p in full precision. This holds the same way
for a decode step, a prefill chunk, a prompt with no cached context, a prefix-cache hit and a
recompute after preemption, so none of them changes a single number: a token's attention
depends on its position, never on how the engine happened to schedule it. (Attending a prompt's
own fresh keys in full precision would make a cold prompt, a cached one and a preempted one
disagree; the tail block alone stays the full-precision window, as KIVI keeps its residual.)

A context is therefore assembled from two parts, ``[quantized complete blocks | own-block
rows]``, with a boolean mask that lets each query see the quantized part before its block and
the exact part within it, causally::

    query in block j:   quantized  [ 0 .. j*bs )      exact  [ j*bs .. p ]

Plans (block ids, staging rows, the mask) are made once per step and shared by every layer.
"""

from dataclasses import dataclass

import torch

from runtime.kv.store import FullStore, QuantStore

Store = FullStore | QuantStore


@dataclass(slots=True)
class SpanPlan:
    """One sequence's prefill span: positions [start, end) with a context of ``end`` tokens."""

    blocks: torch.Tensor  # (nq,) complete blocks (after this step's write), quantized part
    own_pool_slots: torch.Tensor  # (n0,) slots of the own-block rows before the span, [b0, start)
    own_stage_slots: torch.Tensor  # (n0,) the same rows in staging
    mask: torch.Tensor  # (q, nq * bs + end - b0) bool, True where attention is allowed
    num_quantized: int  # nq * bs


@dataclass(slots=True)
class DecodePlan:
    """A padded batch of decode tokens, one per sequence."""

    blocks: torch.Tensor  # (B * nq,) blocks before each token's own block, padded with block 0
    own_blocks: torch.Tensor  # (B,) each token's own block
    own_stages: torch.Tensor  # (B,) its stage (-1 when not staged: a full-precision store's block)
    mask: torch.Tensor  # (B, 1, 1, (nq + 1) * bs) bool
    num_blocks: int  # nq


def plan_span(slots: torch.Tensor, num_new: int, block_size: int, stage_index: torch.Tensor) -> SpanPlan:
    """``slots`` (end,) are the sequence's positions [0, end); the span is its last ``num_new``."""
    bs, end = block_size, slots.shape[0]
    start = end - num_new
    b0 = start // bs * bs  # the span's first own block starts here
    nq = end // bs
    device = slots.device
    blocks = slots[: nq * bs : bs] // bs  # (nq,)
    own_pool_slots = slots[b0:start]  # (n0,)
    stage = int(stage_index[slots[b0] // bs]) if start > b0 else 0
    assert stage >= 0, "a span that starts inside a block needs that block's rows staged"
    own_stage_slots = stage * bs + torch.arange(start - b0, device=device)  # (n0,)

    pos = torch.arange(start, end, device=device)  # (q,) query positions
    own_start = pos // bs * bs  # (q,)
    quantized_ok = torch.arange(nq * bs, device=device)[None, :] < own_start[:, None]  # (q, nq*bs)
    exact_pos = torch.arange(b0, end, device=device)[None, :]  # (1, end - b0)
    exact_ok = (exact_pos >= own_start[:, None]) & (exact_pos <= pos[:, None])  # (q, end - b0)
    mask = torch.cat([quantized_ok, exact_ok], dim=1)
    return SpanPlan(blocks, own_pool_slots, own_stage_slots, mask, nq * bs)


def plan_decode(
    slots: torch.Tensor, mask: torch.Tensor | None, block_size: int, stage_index: torch.Tensor
) -> DecodePlan:
    """``slots`` (B, L) padded contexts; ``mask`` (B, 1, 1, L) marks each row's length (None: all L)."""
    bs = block_size
    batch, length = slots.shape
    device = slots.device
    lengths = mask[:, 0, 0].sum(-1) if mask is not None else torch.full((batch,), length, device=device)
    pos = lengths - 1  # (B,) each decode token's position
    own_start = pos // bs * bs  # (B,)
    nq = int(own_start.max()) // bs
    blocks = slots[:, : nq * bs : bs] // bs  # (B, nq)
    # A shorter row's own block and what follows are padding: point them at block 0, whose
    # storage is always finite. An open block's storage may be uninitialised, and a NaN there
    # would leak through the masked softmax (0 * NaN in the value product).
    before_own = torch.arange(nq, device=device)[None, :] < (own_start // bs)[:, None]
    blocks = torch.where(before_own, blocks, torch.zeros_like(blocks)).reshape(-1)  # (B * nq,)
    own_blocks = slots.gather(1, own_start[:, None])[:, 0] // bs  # (B,)
    cols = torch.arange(nq * bs, device=device)[None, :]
    quantized_ok = cols < own_start[:, None]  # (B, nq*bs)
    exact_ok = torch.arange(bs, device=device)[None, :] <= (pos - own_start)[:, None]  # (B, bs)
    full_mask = torch.cat([quantized_ok, exact_ok], dim=1)[:, None, None, :]  # (B, 1, 1, L')
    return DecodePlan(blocks, own_blocks, stage_index[own_blocks], full_mask, nq)


def assemble_span(store: Store, layer: int, plan: SpanPlan, fresh: torch.Tensor) -> torch.Tensor:
    """``[quantized blocks | own rows before the span | the span's fresh rows]``: (KVH, L', D)."""
    num_kv_heads, _, head_dim = fresh.shape
    nq, n0 = plan.num_quantized, plan.own_pool_slots.shape[0]
    length = plan.mask.shape[1]
    out = store.scratch.get("context", (num_kv_heads, length, head_dim), fresh.dtype, fresh.device)
    if nq:
        blocks = out[:, :nq].view(num_kv_heads, -1, store.block_size, head_dim)  # (KVH, nq/bs, bs, D)
        store.read_blocks_into(layer, plan.blocks, blocks)
    if n0:
        out[:, nq : nq + n0] = store.own_rows(layer, plan.own_pool_slots, plan.own_stage_slots)
    out[:, nq + n0 :] = fresh
    return out


def assemble_decode(store: Store, layer: int, plan: DecodePlan, dtype: torch.dtype) -> torch.Tensor:
    """Per row ``[nq blocks before its own | its own block exact]``: (B, KVH, (nq + 1) * bs, D)."""
    batch, nq, bs = plan.own_blocks.shape[0], plan.num_blocks, store.block_size
    num_kv_heads, head_dim = store.num_kv_heads, store.head_dim
    out = store.scratch.get("context", (num_kv_heads, batch, nq + 1, bs, head_dim), dtype, plan.blocks.device)
    if nq:
        store.read_blocks_into(layer, plan.blocks, out[:, :, :nq])  # (KVH, B, nq, bs, D)
    out[:, :, nq] = store.own_blocks(layer, plan.own_blocks, plan.own_stages)  # (KVH, B, bs, D)
    return out.view(num_kv_heads, batch, (nq + 1) * bs, head_dim).transpose(0, 1)
