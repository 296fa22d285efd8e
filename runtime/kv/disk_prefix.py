"""Between the in-memory prefix cache and its disk tier: what is saved when, what is loaded how.

A sealed block goes to disk when it leaves the in-memory LRU (allocation is about to reuse it:
:meth:`DiskPrefixCache.save_evicted`, called while its KV is still intact) and when its request
ends (:meth:`save_sequence`), unless the tier has it already. Both copy the blocks' bytes out of
the pool at once, a memory copy, and leave the file writes to the tier's background thread.

On admission, after the in-memory hit, :meth:`extend_hit` continues the chain from disk: block by
block while files exist and verify, into free blocks that are then cached like any other, so
the scheduler admits them as an ordinary prefix hit. It never takes a block the hit itself
holds, and leaves at least one free block for the tokens still to compute.
"""

import time

import torch

from runtime.engine.sequence import Sequence
from runtime.kv.block_manager import BlockManager, EvictedBlock, PrefixHit
from runtime.kv.cache import KVCache
from runtime.kv.disk_tier import DiskTier


class DiskPrefixCache:
    def __init__(self, tier: DiskTier, block_manager: BlockManager, kv_cache: KVCache) -> None:
        self.tier = tier
        self.block_manager = block_manager
        self.kv_cache = kv_cache
        self.block_size = block_manager.block_size
        self.num_hit_tokens = 0

    # -- saving --------------------------------------------------------------------------------

    def save_evicted(self, evicted: list[EvictedBlock]) -> None:
        new = [e for e in evicted if not self.tier.has(e.block_hash)]
        if new and self.tier.enabled:
            data = self.kv_cache.export_blocks([e.block_id for e in new])
            self.tier.save([e.block_hash for e in new], [e.token_ids for e in new], data)

    def save_sequence(self, seq: Sequence) -> None:
        """Save the sealed blocks of a request that is ending (before its blocks are freed)."""
        if not self.tier.enabled:
            return
        bs = self.block_size
        ids, digests, tokens = [], [], []
        for i, digest in enumerate(seq.block_hashes):
            if not self.tier.has(digest):
                ids.append(seq.block_table[i])
                digests.append(digest)
                tokens.append(tuple(seq.token_ids[i * bs : (i + 1) * bs]))
        if ids:
            self.tier.save(digests, tokens, self.kv_cache.export_blocks(ids))

    # -- loading -------------------------------------------------------------------------------

    def extend_hit(self, seq: Sequence, hit: PrefixHit) -> None:
        """Append to ``hit`` the blocks after it that the disk holds (loaded into the pool now)."""
        if not self.tier.enabled:
            return
        bm, bs = self.block_manager, self.block_size
        start = len(hit.block_ids)
        num_wanted = (len(seq) - 1) // bs - start  # at least one token is left to compute
        num_revived = sum(1 for b in hit.block_ids if bm.blocks[b].ref_cnt == 0)
        room = min(num_wanted, bm.num_free_blocks - num_revived - 1)
        if room <= 0 or not self.tier.path_for(seq.block_digest(start, bs)).exists():
            return
        began = time.perf_counter()
        data = torch.empty((room, self.kv_cache.bytes_per_block), dtype=torch.uint8)
        digests: list[bytes] = []
        tokens: list[tuple[int, ...]] = []
        for i in range(start, start + room):
            digest = seq.block_digest(i, bs)
            block_tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if digest in bm.cached_blocks:  # in memory after all: the chain goes on there next time
                break
            if not self.tier.load_into(digest, block_tokens, data[len(digests)]):
                break
            digests.append(digest)
            tokens.append(block_tokens)
        if digests:
            block_ids = bm.adopt_loaded_blocks(hit, digests, tokens)
            self.kv_cache.import_blocks(block_ids, data[: len(digests)])
            num_tokens = len(digests) * bs
            seq.num_disk_loaded_tokens += num_tokens
            self.num_hit_tokens += num_tokens
        seq.metrics.disk_load_ms += (time.perf_counter() - began) * 1000
