"""Physical KV blocks: allocation, reference counts and the prefix cache.

Each block holds ``block_size`` consecutive tokens of one sequence. A block that is full is
*sealed*: it gets a chained digest, blake2b of its parent's digest and its token ids' bytes
(:func:`block_digest`), and is registered in the prefix cache so that any later sequence starting
with the same tokens can share it. The digest is the same in every process (Python's ``hash()``
of ``None`` is not, on 3.11), so the disk tier (``runtime/kv/disk_tier.py``) files blocks by it.

Blocks nobody references sit in ``free_queue`` in eviction order (front is evicted first)::

    front  [empty blocks] [cached blocks, least recently freed ... most recently freed]  back

A freed sequence returns its blocks tail first, so a request's deep blocks are evicted before
its prefix blocks, which are the ones other requests are most likely to share. Allocation
takes from the front; taking a cached block evicts it from the prefix cache. A cache hit on an
unreferenced block takes it out of the queue again.

``on_release`` (the KV pool's) hears of every block that returns to the queue holding nothing
reusable, so storage kept per open block (a quantized pool's full-precision staging) is freed
with it. ``on_evict`` hears of every cached block just before allocation takes it, while its KV
is still intact, so the disk tier can keep a copy.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from runtime.engine.sequence import Sequence
from runtime.kv.digest import block_digest

__all__ = ["Block", "BlockManager", "EvictedBlock", "PrefixHit", "block_digest"]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block is registered in the prefix cache
    token_ids: tuple[int, ...] | None = None  # kept to verify hits against hash collisions


@dataclass(slots=True)
class PrefixHit:
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass(slots=True, frozen=True)
class EvictedBlock:
    """A cached block allocation is about to reuse: its id, digest and tokens, KV still intact."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_release: Callable[[list[int]], None] | None = None,
        on_evict: Callable[[list[EvictedBlock]], None] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.on_release = on_release
        self.on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # block digest -> block id
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_hittable_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (empty or holding an evictable cached prefix)."""
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for block_id in self.free_queue if self.blocks[block_id].block_hash is not None)

    # -- prefix cache -------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest chain of cached blocks that starts ``seq``.

        At least one token is always left to compute: the model needs the last token's logits.
        """
        hit = PrefixHit([], [])
        if not self.enable_prefix_caching:
            return hit
        max_blocks = (len(seq) - 1) // self.block_size
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = seq.block_digest(i, self.block_size)
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hit.block_ids.append(block_id)
            hit.block_hashes.append(block_hash)
        return hit

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix held by an unreferenced block; referenced blocks keep theirs.

        The forgotten blocks stay where they are in ``free_queue``: they now hold nothing
        reusable, like the empty blocks before them, and are handed out in the same order.
        """
        for block_id in self.free_queue:
            self._forget_prefix(block_id)

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens
        self.num_hittable_tokens += (num_tokens - 1) // self.block_size * self.block_size

    # -- allocation ---------------------------------------------------------------------------

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_admit(self, hit: PrefixHit, num_tokens_after: int) -> bool:
        """Whether a waiting sequence with this prefix hit can hold ``num_tokens_after`` tokens."""
        num_new = -(-num_tokens_after // self.block_size) - len(hit.block_ids)
        num_revived = sum(1 for b in hit.block_ids if self.blocks[b].ref_cnt == 0)
        return num_new + num_revived <= self.num_free_blocks

    def admit(self, seq: Sequence, hit: PrefixHit) -> None:
        """Give ``seq`` the hit blocks; it starts computing after them."""
        assert not seq.block_table, f"{seq.request_id} is admitted while holding blocks"
        for block_id in hit.block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1
        seq.block_table = list(hit.block_ids)
        seq.block_hashes = list(hit.block_hashes)
        seq.num_computed_tokens = len(hit.block_ids) * self.block_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of KV; False (allocating nothing) when full."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take_free_blocks(needed))
        return True

    def _take_free_blocks(self, num_blocks: int) -> list[int]:
        taken = [self.free_queue.popitem(last=False)[0] for _ in range(num_blocks)]
        evicted = [
            EvictedBlock(b, block.block_hash, block.token_ids)
            for b in taken
            if (block := self.blocks[b]).block_hash is not None and block.token_ids is not None
        ]
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        for block_id in taken:
            self._forget_prefix(block_id)
            self.blocks[block_id].ref_cnt = 1
        return taken

    def adopt_loaded_blocks(
        self, hit: PrefixHit, digests: list[bytes], tokens: list[tuple[int, ...]]
    ) -> list[int]:
        """Take free blocks for KV about to be loaded from disk, cache them under ``digests`` and
        append them to ``hit``; returns their ids, which the caller fills before the next step.

        The hit's own unreferenced blocks move to the back of the queue first (they are about to
        be used), so taking from the front never takes one of them; the caller keeps
        ``len(digests)`` within ``num_free_blocks`` less those.
        """
        for block_id in hit.block_ids:
            if block_id in self.free_queue:
                self.free_queue.move_to_end(block_id)
        taken = self._take_free_blocks(len(digests))
        for block_id, digest, token_ids in zip(taken, digests, tokens, strict=True):
            block = self.blocks[block_id]
            block.ref_cnt = 0
            block.block_hash = digest
            block.token_ids = token_ids
            self.cached_blocks[digest] = block_id
            self.free_queue[block_id] = None  # cached and unreferenced, most recently used
        hit.block_ids.extend(taken)
        hit.block_hashes.extend(digests)
        return taken

    def _forget_prefix(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def seal_full_blocks(self, seq: Sequence) -> list[int]:
        """Hash and cache every block of ``seq`` that became full; return the newly sealed ids."""
        sealed: list[int] = []
        num_full = seq.num_computed_tokens // self.block_size
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = seq.block_digest(i, self.block_size)
            seq.block_hashes.append(block_hash)
            block_id = seq.block_table[i]
            sealed.append(block_id)
            if self.enable_prefix_caching and block_hash not in self.cached_blocks:
                block = self.blocks[block_id]
                block.block_hash = block_hash
                block.token_ids = tokens
                self.cached_blocks[block_hash] = block_id
        return sealed

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s blocks past its first ``num_tokens`` tokens (rejected guesses'
        slots); they hold nothing sealed, so they go to the front of the queue like empty ones."""
        keep = -(-num_tokens // self.block_size)
        if keep >= len(seq.block_table):
            return
        assert keep >= len(seq.block_hashes), f"{seq.request_id}: trimming a sealed block"
        released = seq.block_table[keep:]
        del seq.block_table[keep:]
        for block_id in reversed(released):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt == 0 and block.block_hash is None, f"block {block_id} is shared or cached"
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)
        if self.on_release is not None:
            self.on_release(released)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first; cached blocks stay reusable until evicted."""
        released: list[int] = []
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    # Holds nothing reusable, so it is the first to hand out again.
                    self.free_queue.move_to_end(block_id, last=False)
                    released.append(block_id)
        if released and self.on_release is not None:
            self.on_release(released)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks
