"""Where one of K or V lives: in the model dtype at its slots, or quantized block by block.

:class:`FullStore` keeps ``(num_kv_heads, num_slots, head_dim)`` per layer in the model dtype: the
attention hook's keys are ``(1, num_kv_heads, T, head_dim)``, so a write is one ``index_copy_``
along dim 1 and a gather already has the layout SDPA wants.

:class:`QuantStore` keeps each layer as the codec's parts, ``(num_kv_heads, num_blocks, ...)``,
plus a small full-precision *staging* area for blocks that are still open (a sequence's partial
tail block, and a block its last token filled in this step). A block is quantized in the write
that fills its last slot, straight from the step's keys or from its staged rows. Reads
dequantize just the blocks a context covers, never the pool.

Both stores answer the same three reads, which :class:`~runtime.kv.cache.KVCache` assembles:
complete blocks (:meth:`read_blocks_into`), and a sequence's own-block rows in full precision by
position (:meth:`own_rows`) or as whole blocks (:meth:`own_blocks`). Results live in per-store
scratch buffers, valid until the store's next read: the attention hook consumes each context
before reading the next, and reusing buffers saves the page faults of fresh multi-megabyte
tensors every layer.
"""

from dataclasses import dataclass

import torch

from runtime.kv.quant import Codec, Scratch


@dataclass(slots=True)
class WritePlan:
    """Where a step's tokens go; the same for every layer and for K and V."""

    stage_tokens: torch.Tensor  # (S,) packed token indices written to staging
    stage_slots: torch.Tensor  # (S,) their staging slots (stage * block_size + offset)
    fresh_tokens: torch.Tensor  # (F * bs,) tokens that fill whole blocks within this step, by block
    closing_stages: torch.Tensor  # (C,) stages of staged blocks this step fills
    sealed_blocks: torch.Tensor  # (F + C,) block ids quantized this step: fresh ones, then closing ones


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    # float8 is held as raw bytes: torch has no CPU index_copy_ for it.
    return torch.uint8 if dtype.itemsize == 1 and dtype.is_floating_point else dtype


class FullStore:
    """Keys or values in the model dtype, addressed by slot."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        # torch.empty maps pages lazily on CPU, so an unused pool costs address space, not RAM.
        self.cache = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for layer in self.cache:
            layer[:, :block_size].zero_()  # block 0 backs decode padding: keep it finite
        self.scratch = Scratch()

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.cache)

    def write(self, layer: int, slot_mapping: torch.Tensor, x: torch.Tensor, plan: WritePlan | None) -> None:
        self.cache[layer].index_copy_(1, slot_mapping, x)  # x (KVH, T, D)

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Rows at ``slots`` (any shape, flattened) into a reused buffer: (KVH, L, D)."""
        cache = self.cache[layer]
        out = self.scratch.get(
            "context", (cache.shape[0], slots.numel(), cache.shape[2]), cache.dtype, cache.device
        )
        return torch.index_select(cache, 1, slots.reshape(-1), out=out)  # (KVH, L, D)

    def gather_batch(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        batch, length = slots.shape
        x = self.gather(layer, slots)  # (KVH, B*L, D)
        return x.view(x.shape[0], batch, length, x.shape[-1]).transpose(0, 1)  # (B, KVH, L, D)

    # The quantized-cache reads, for a full-precision side next to a quantized one (e.g. int8 K, auto V).

    def _blocks(self, layer: int) -> torch.Tensor:
        c = self.cache[layer]
        return c.view(c.shape[0], -1, self.block_size, c.shape[2])  # (KVH, blocks, bs, D)

    def read_blocks_into(self, layer: int, blocks: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(self._blocks(layer).index_select(1, blocks).view(out.shape))  # (KVH, ..., bs, D)

    def own_rows(self, layer: int, pool_slots: torch.Tensor, stage_slots: torch.Tensor) -> torch.Tensor:
        return self.cache[layer].index_select(1, pool_slots)  # (KVH, n, D)

    def own_blocks(self, layer: int, blocks: torch.Tensor, stages: torch.Tensor) -> torch.Tensor:
        return self._blocks(layer).index_select(1, blocks)  # (KVH, B, bs, D)

    def block_parts(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's stored blocks, (KVH, num_blocks, ...) views in their stored dtype: what a
        block file holds."""
        return (self._blocks(layer),)  # (KVH, blocks, bs, D)


class QuantStore:
    """Keys or values quantized per block by ``codec``, with open blocks staged in full precision."""

    def __init__(
        self, codec: Codec, num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int,
        head_dim: int, dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.codec = codec
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        specs = codec.parts(block_size, head_dim)
        self.part_dtypes = tuple(spec.dtype for spec in specs)
        self.parts: list[tuple[torch.Tensor, ...]] = []
        for _ in range(num_layers):
            layer = tuple(
                torch.empty(
                    (num_kv_heads, num_blocks, *spec.shape), dtype=_storage_dtype(spec.dtype), device=device
                )
                for spec in specs
            )
            for t in layer:
                t[:, 0].zero_()  # block 0 backs decode padding: zero scales keep it finite
            self.parts.append(layer)
        self.staging = [self._new_staging(num_kv_heads, 0) for _ in range(num_layers)]
        self.scratch = Scratch()

    def _new_staging(self, num_kv_heads: int, num_stages: int) -> torch.Tensor:
        # Zeros, not empty: rows past a block's last token are read (and masked) in decode.
        with torch.inference_mode(False):  # a normal tensor, writable in and out of inference mode
            shape = (num_kv_heads, num_stages * self.block_size, self.head_dim)
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.parts for t in layer)

    def grow_staging(self, num_stages: int) -> None:
        """Make room for ``num_stages`` open blocks, keeping what is staged."""
        for i, old in enumerate(self.staging):
            new = self._new_staging(old.shape[0], num_stages)
            new[:, : old.shape[1]] = old
            self.staging[i] = new

    def _staged_blocks(self, layer: int) -> torch.Tensor:
        s = self.staging[layer]
        return s.view(s.shape[0], -1, self.block_size, self.head_dim)  # (KVH, stages, bs, D)

    def write(self, layer: int, slot_mapping: torch.Tensor, x: torch.Tensor, plan: WritePlan | None) -> None:
        assert plan is not None, "a quantized store needs the step's write plan"
        num_kv_heads, bs, d = x.shape[0], self.block_size, self.head_dim
        if plan.stage_tokens.numel():
            self.staging[layer].index_copy_(1, plan.stage_slots, x.index_select(1, plan.stage_tokens))
        if not plan.sealed_blocks.numel():
            return
        full: list[torch.Tensor] = []
        if plan.fresh_tokens.numel():
            full.append(x.index_select(1, plan.fresh_tokens).view(num_kv_heads, -1, bs, d))  # (KVH, F, bs, D)
        if plan.closing_stages.numel():
            full.append(self._staged_blocks(layer).index_select(1, plan.closing_stages))  # (KVH, C, bs, D)
        blocks = full[0] if len(full) == 1 else torch.cat(full, dim=1)  # (KVH, F + C, bs, D)
        for stored, part in zip(self.parts[layer], self.codec.quantize(blocks), strict=True):
            stored.index_copy_(1, plan.sealed_blocks, part.view(stored.dtype))

    def read_blocks_into(self, layer: int, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """Dequantize ``blocks`` (m,) into ``out`` (KVH, ..., bs, D) whose middle dims hold m blocks."""
        parts = []
        for i, (stored, dtype) in enumerate(zip(self.parts[layer], self.part_dtypes, strict=True)):
            buf = self.scratch.get(
                f"part{i}", (stored.shape[0], blocks.shape[0], *stored.shape[2:]), stored.dtype, self.device
            )
            part = torch.index_select(stored, 1, blocks, out=buf).view(dtype)  # (KVH, m, ...)
            parts.append(part.view(*out.shape[:-2], *part.shape[2:]))  # the middle dims of ``out``
        self.codec.dequantize_into(tuple(parts), out, self.scratch)

    def own_rows(self, layer: int, pool_slots: torch.Tensor, stage_slots: torch.Tensor) -> torch.Tensor:
        return self.staging[layer].index_select(1, stage_slots)  # (KVH, n, D)

    def block_parts(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's sealed blocks, one (KVH, num_blocks, ...) tensor per part: quantized blocks
        stay quantized on disk (staging is never saved: only sealed blocks are)."""
        return self.parts[layer]

    def own_blocks(self, layer: int, blocks: torch.Tensor, stages: torch.Tensor) -> torch.Tensor:
        return self._staged_blocks(layer).index_select(1, stages)  # (KVH, B, bs, D)
