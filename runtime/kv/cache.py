"""The KV pool: key and value storage for every layer, addressed by slot, in a chosen dtype each.

A slot is ``block_id * block_size + offset``. Keys and values each get a store
(``runtime/kv/store.py``): the model dtype (``auto``) kept at its slots, or a quantized format
(``runtime/kv/quant.py``) kept block by block. A quantized block is written once, in the step that
fills its last slot; until the engine seals it (the end of that step) its rows also sit in a
full-precision staging area, which grows on demand and holds at most two blocks per running
sequence (one between steps). :meth:`KVCache.seal` and :meth:`KVCache.release` give it back.

A full-precision cache is read as it always was (:meth:`KVCache.gather`,
:meth:`KVCache.gather_batch`). A quantized one is read through :meth:`KVCache.read_span` and
:meth:`KVCache.read_decode`, which give each token its earlier blocks quantized and its own
block exact (``runtime/kv/context.py``). The model runner calls :meth:`KVCache.begin_step` once per
step, before the forward: the cache plans there which rows go to staging and which blocks get
quantized, and drops the previous step's read plans. It plans once per span (and once for the
decode batch) what it reads; every layer reuses the plans.
"""

import heapq
from dataclasses import dataclass

import torch

from runtime.kv.context import DecodePlan, SpanPlan, assemble_decode, assemble_span, plan_decode, plan_span
from runtime.kv.quant import Codec, codec_for
from runtime.kv.store import FullStore, QuantStore, WritePlan


@dataclass(slots=True, frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's: what ``auto`` stores and what reads return
    block_size: int = 16
    k_dtype: str = "auto"
    v_dtype: str = "auto"

    def __post_init__(self) -> None:
        codec_for(self.k_dtype, is_key=True)  # raises ValueError on an unknown name
        codec_for(self.v_dtype, is_key=False)
        if self.quantized and self.block_size < 2:
            raise ValueError("quantized KV works on whole blocks: use a block size of at least 2")
        if self.bytes_per_block % self.block_size:
            raise ValueError(
                f"with block_size {self.block_size}, {self.k_dtype} keys' per-block scales do not "
                f"divide evenly into tokens; use a block size of at most {self.head_dim}"
            )

    @property
    def quantized(self) -> bool:
        return (self.k_dtype, self.v_dtype) != ("auto", "auto")

    @property
    def k_codec(self) -> Codec | None:
        return codec_for(self.k_dtype, is_key=True)

    @property
    def v_codec(self) -> Codec | None:
        return codec_for(self.v_dtype, is_key=False)

    def _bytes_per_head_block(self, codec: Codec | None) -> int:
        if codec is None:
            return self.block_size * self.head_dim * self.dtype.itemsize
        return codec.bytes_per_block(self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Exact: layers x KV heads x (K's bytes + V's bytes) of one block, scales included."""
        per_head = self._bytes_per_head_block(self.k_codec) + self._bytes_per_head_block(self.v_codec)
        return self.num_layers * self.num_kv_heads * per_head

    @property
    def bytes_per_token(self) -> int:
        """Exact (``__post_init__`` checks the division): per-block scales amortised over the block."""
        return self.bytes_per_block // self.block_size

    @property
    def staging_bytes_per_block(self) -> int:
        """Full-precision bytes one open block takes in staging (quantized stores only)."""
        num_quantized = (self.k_codec is not None) + (self.v_codec is not None)
        per_store = (
            self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * self.dtype.itemsize
        )
        return num_quantized * per_store


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


Store = FullStore | QuantStore


class KVCache:
    def __init__(
        self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device,
        scratch_block: bool = False,
    ) -> None:  # fmt: skip
        """A pool of ``num_blocks`` blocks; with ``scratch_block`` (full-precision pools only) one
        more block past them that the block manager never hands out: the compiled decode step's
        padded rows write there (``runtime/layers/compiled_step.py``)."""
        if layout.block_size != block_size:
            raise ValueError(f"layout block size {layout.block_size} != pool block size {block_size}")
        if scratch_block and layout.quantized:
            raise ValueError("a scratch block is for full-precision KV pools only")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.quantized = layout.quantized
        # The first slot of the scratch block, or None without one.
        self.scratch_slot: int | None = num_blocks * block_size if scratch_block else None
        self.key_store = self._store(layout.k_codec, num_blocks + scratch_block)
        self.value_store = self._store(layout.v_codec, num_blocks + scratch_block)
        if scratch_block:
            for store in (self.key_store, self.value_store):
                assert isinstance(store, FullStore)
                for layer in store.cache:
                    layer[:, num_blocks * block_size :].zero_()  # read under the mask: keep it finite

        # Staging bookkeeping: which block holds which stage, and the same as a tensor (-1: none)
        # so reads look stages up without Python.
        self._stage_of: dict[int, int] = {}
        self._free_stages: list[int] = []  # a heap: the lowest stage first keeps staging compact
        self._num_stages = 0
        self._stage_index = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        # This step's plans (quantized only), made by begin_step and on a span's first read.
        self._num_step_tokens = 0
        self._write_plan: WritePlan | None = None
        self._span_plans: dict[int, SpanPlan] = {}  # a prefill span's first packed index -> plan
        self._decode_plan: DecodePlan | None = None

    def _store(self, codec: Codec | None, n: int) -> Store:
        lay, bs = self.layout, self.block_size
        if codec is None:
            return FullStore(lay.num_layers, lay.num_kv_heads, n, bs, lay.head_dim, lay.dtype, self.device)
        return QuantStore(
            codec, lay.num_layers, lay.num_kv_heads, n, bs, lay.head_dim, lay.dtype, self.device
        )

    # -- sizes --------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block

    @property
    def pool_nbytes(self) -> int:
        """Bytes actually allocated for the pool: ``num_blocks * bytes_per_block``, plus one block
        with a scratch block."""
        return self.key_store.nbytes() + self.value_store.nbytes()

    @property
    def staging_bytes(self) -> int:
        """Full-precision staging allocated now (outside ``bytes_per_token``)."""
        return self._num_stages * self.layout.staging_bytes_per_block

    @property
    def num_open_blocks(self) -> int:
        """Blocks holding staging now: written, not yet sealed or released."""
        return len(self._stage_of)

    @property
    def k_dtype(self) -> str:
        return dtype_name(self.layout.dtype) if self.layout.k_dtype == "auto" else self.layout.k_dtype

    @property
    def v_dtype(self) -> str:
        return dtype_name(self.layout.dtype) if self.layout.v_dtype == "auto" else self.layout.v_dtype

    # -- the model runner's interface ---------------------------------------------------------

    def begin_step(self, slot_mapping: torch.Tensor) -> None:
        """Start a step that writes its tokens at ``slot_mapping`` (T,); called before the forward.

        A quantized cache plans the step's writes here, once for every layer, and forgets the
        previous step's read plans. A full-precision one needs no plans.
        """
        if not self.quantized:
            return
        self._clear_read_plans()
        self._write_plan = self._plan_write(slot_mapping)
        self._num_step_tokens = slot_mapping.shape[0]

    # -- the attention hook's interface -------------------------------------------------------

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new keys/values (num_kv_heads, T, head_dim) at ``slot_mapping`` (T,)."""
        plan = None
        if self.quantized:
            plan = self._write_plan
            if plan is None or slot_mapping.shape[0] != self._num_step_tokens:
                raise RuntimeError(
                    f"KVCache.write of {slot_mapping.shape[0]} tokens without a begin_step for them"
                )
        self.key_store.write(layer, slot_mapping, key, plan)
        self.value_store.write(layer, slot_mapping, value, plan)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (L,) as (num_kv_heads, L, head_dim); full precision only."""
        assert isinstance(self.key_store, FullStore) and isinstance(self.value_store, FullStore)
        return self.key_store.gather(layer, slots), self.value_store.gather(layer, slots)

    def gather_batch(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values for padded contexts ``slots`` (B, L): (B, num_kv_heads, L, head_dim)."""
        assert isinstance(self.key_store, FullStore) and isinstance(self.value_store, FullStore)
        return self.key_store.gather_batch(layer, slots), self.value_store.gather_batch(layer, slots)

    def read_span(
        self, layer: int, span_start: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prefill span's keys and values (KVH, L', D) and mask (q, L'), quantized cache only.

        ``span_start``, the span's first index in the packed step, names it within the step (its
        plan serves every layer); ``slots`` (end,) are its sequence's positions [0, end);
        ``key``/``value`` (KVH, q, D) its fresh rows.
        """
        plan = self._span_plans.get(span_start)
        if plan is None:
            plan = plan_span(slots, key.shape[1], self.block_size, self._stage_index)
            self._span_plans[span_start] = plan
        k = assemble_span(self.key_store, layer, plan, key)
        v = assemble_span(self.value_store, layer, plan, value)
        return k, v, plan.mask

    def read_decode(
        self, layer: int, slots: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode batch's keys and values (B, KVH, L', D) and mask (B, 1, 1, L'), quantized only.

        ``slots`` (B, L) and ``mask`` (B, 1, 1, L) or None describe the batch's padded contexts;
        a step has one decode batch, so its plan serves every layer.
        """
        plan = self._decode_plan
        if plan is None:
            plan = self._decode_plan = plan_decode(slots, mask, self.block_size, self._stage_index)
        k = assemble_decode(self.key_store, layer, plan, self.layout.dtype)
        v = assemble_decode(self.value_store, layer, plan, self.layout.dtype)
        return k, v, plan.mask

    def _clear_read_plans(self) -> None:
        self._span_plans.clear()
        self._decode_plan = None

    # -- the engine's interface ---------------------------------------------------------------

    def seal(self, block_ids: list[int]) -> None:
        """Called after a step with the blocks it filled: quantized already, their staging goes."""
        self._drop_stages(block_ids)

    def release(self, block_ids: list[int]) -> None:
        """Called when blocks go back to the free queue holding nothing reusable (unsealed)."""
        self._drop_stages(block_ids)

    def _drop_stages(self, block_ids: list[int]) -> None:
        dropped = [b for b in block_ids if b in self._stage_of]
        for block_id in dropped:
            heapq.heappush(self._free_stages, self._stage_of.pop(block_id))
        if dropped:
            self._stage_index[torch.tensor(dropped, device=self.device)] = -1
            self._clear_read_plans()  # they point at the dropped stages

    # -- the disk tier's interface -------------------------------------------------------------

    def _block_parts(self) -> list[torch.Tensor]:
        # K's layers then V's, each layer's parts in order: the order of a block's bytes on disk.
        return [v for store in (self.key_store, self.value_store) for layer in range(self.layout.num_layers)
                for v in store.block_parts(layer)]  # fmt: skip

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Sealed blocks' stored bytes, (n, bytes_per_block) uint8 on the CPU, one row per block."""
        out = torch.empty((len(block_ids), self.bytes_per_block), dtype=torch.uint8, device=self.device)
        for part, rows in self._part_rows(out):
            for i, block_id in enumerate(block_ids):
                rows[i].copy_(part[:, block_id])
        return out.cpu()

    def import_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write blocks' stored bytes ``data`` (n, bytes_per_block) uint8, as :meth:`export_blocks`
        gave them, into ``block_ids``; they read as sealed blocks from the next step on."""
        if data.shape != (len(block_ids), self.bytes_per_block):
            raise ValueError(f"block data of shape {tuple(data.shape)} for {len(block_ids)} blocks")
        self._drop_stages(block_ids)  # (free blocks hold none; a stale one would shadow the load)
        for part, rows in self._part_rows(data.to(self.device)):
            for i, block_id in enumerate(block_ids):
                part[:, block_id].copy_(rows[i])

    def _part_rows(self, data: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each stored part (KVH, num_blocks, ...) with its columns of ``data`` (n, bytes_per_block)
        seen as (n, KVH, ...) in the part's dtype, in place.

        One block at a time, not one index_copy_ per part: torch copies these strided views at a
        fraction of memory speed, while a block's part is a few KiB-long contiguous runs per head.
        """
        pairs = []
        offset = 0
        for part in self._block_parts():
            width = part[:, 0].numel() * part.itemsize
            columns = data[:, offset : offset + width]
            # A part's bytes start at a multiple of its itemsize in every layout liubai has (the
            # parts before it are whole fp16/fp32 rows or sized in multiples of 4).
            rows = columns.view(part.dtype).view(data.shape[0], part.shape[0], *part.shape[2:])
            pairs.append((part, rows))
            offset += width
        return pairs

    # -- the write plan -----------------------------------------------------------------------

    def _take_stage(self, block_id: int) -> int:
        if not self._free_stages:
            grown = min(self.num_blocks, max(4, 2 * self._num_stages))
            for store in (self.key_store, self.value_store):
                if isinstance(store, QuantStore):
                    store.grow_staging(grown)
            self._free_stages = list(range(self._num_stages, grown))
            self._num_stages = grown
        stage = heapq.heappop(self._free_stages)
        self._stage_of[block_id] = stage
        self._stage_index[block_id] = stage
        return stage

    def _plan_write(self, slot_mapping: torch.Tensor) -> WritePlan:
        bs = self.block_size
        slots: list[int] = slot_mapping.tolist()
        by_block: dict[int, list[int]] = {}  # block -> indices of its tokens in this step, in order
        for i, slot in enumerate(slots):
            by_block.setdefault(slot // bs, []).append(i)
        stage_tokens: list[int] = []
        stage_slots: list[int] = []
        fresh_tokens: list[int] = []
        fresh_blocks: list[int] = []
        closing_stages: list[int] = []
        closing_blocks: list[int] = []
        for block, tokens in by_block.items():
            first, last = slots[tokens[0]] % bs, slots[tokens[-1]] % bs
            fills = last == bs - 1  # sequences write their blocks in order, so this closes it
            if fills and first == 0:  # a whole block in one step: quantized straight from the keys
                self._drop_stages([block])  # (a stale stage would mean a missed release)
                fresh_blocks.append(block)
                fresh_tokens.extend(tokens)
                continue
            stage = self._stage_of.get(block)
            if stage is None:
                stage = self._take_stage(block)
            stage_tokens.extend(tokens)
            stage_slots.extend(stage * bs + slots[i] % bs for i in tokens)
            if fills:  # quantized from staging now; seal() frees the stage after the step
                closing_blocks.append(block)
                closing_stages.append(stage)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return WritePlan(
            stage_tokens=as_tensor(stage_tokens),
            stage_slots=as_tensor(stage_slots),
            fresh_tokens=as_tensor(fresh_tokens),
            closing_stages=as_tensor(closing_stages),
            sealed_blocks=as_tensor(fresh_blocks + closing_blocks),
        )


def num_blocks_for(pool_bytes: int, bytes_per_token: int, block_size: int) -> int:
    return pool_bytes // (bytes_per_token * block_size)
