"""The block manager's bookkeeping, asserted exactly: block ids, reference counts, the prefix
cache and the eviction order of freed blocks."""

import torch

from runtime.engine.sampling import SamplingParams
from runtime.engine.sequence import Sequence
from runtime.kv.block_manager import BlockManager, block_digest

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4), None, [], torch.device("cpu"))


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """What the scheduler and engine do for a whole prompt in one step."""
    hit = bm.find_cached_prefix(s)
    bm.admit(s, hit)
    assert bm.allocate_slots(s, len(s) - s.num_computed_tokens)
    s.num_computed_tokens = len(s)
    bm.seal_full_blocks(s)


def test_allocation_takes_blocks_in_order_and_seals_full_ones() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(list(range(10)))
    run_prefill(bm, a)
    assert a.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 0]
    assert a.block_hashes == [block_digest(None, (0, 1, 2, 3)), block_digest(a.block_hashes[0], (4, 5, 6, 7))]
    assert set(bm.cached_blocks.values()) == {0, 1}  # the partial third block is not cached
    assert bm.num_free_blocks == 5


def test_shared_prefix_is_reused_and_ref_counted() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(list(range(10)), "a")
    run_prefill(bm, a)
    b = seq(list(range(8)) + [99, 98, 97], "b")
    hit = bm.find_cached_prefix(b)
    assert hit.block_ids == [0, 1]
    run_prefill(bm, b)
    assert b.block_table == [0, 1, 3]
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    bm.free(b)
    assert bm.num_used_blocks() == 0


def test_at_least_one_token_is_always_recomputed() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    run_prefill(bm, seq(list(range(8)), "a"))
    again = seq(list(range(8)), "b")
    assert bm.find_cached_prefix(again).block_ids == [0]  # not both: the 8th token must run


def test_freed_blocks_are_evicted_least_recently_used_first_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = seq(list(range(9)), "a")  # blocks 0, 1 full; 2 partial
    b = seq(list(range(100, 109)), "b")  # blocks 3, 4 full; 5 partial
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a)
    bm.free(b)
    # Partial blocks hold nothing reusable and come first; then a's blocks (freed earlier),
    # each request tail first.
    assert list(bm.free_queue) == [5, 2, 1, 0, 4, 3]
    c = seq(list(range(200, 213)), "c")  # needs 4 blocks, shares nothing
    run_prefill(bm, c)
    assert c.block_table == [5, 2, 1, 0]
    assert set(bm.cached_blocks.values()) == {3, 4, 5, 2, 1}, "a's blocks were evicted, b's survive"
    assert bm.find_cached_prefix(seq(list(range(9)), "a2")).block_ids == []
    assert bm.find_cached_prefix(seq(list(range(100, 109)), "b2")).block_ids == [3, 4]


def test_cache_hit_revives_an_unreferenced_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq(list(range(5)), "a")
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq(list(range(6)), "b")
    run_prefill(bm, b)
    assert b.block_table[0] == 0 and bm.blocks[0].ref_cnt == 1
    assert 0 not in bm.free_queue


def test_hash_collision_is_caught_by_token_verification() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    run_prefill(bm, seq([1, 2, 3, 4, 5], "a"))
    # Forge a collision: make the cached block claim different tokens under the same hash.
    bm.blocks[0].token_ids = (9, 9, 9, 9)
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5], "b")).block_ids == []


def test_allocation_fails_cleanly_when_full() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = seq(list(range(6)), "a")
    run_prefill(bm, a)
    b = seq(list(range(50, 56)), "b")
    bm.admit(b, bm.find_cached_prefix(b))
    assert not bm.allocate_slots(b, 6)
    assert b.block_table == [] and bm.num_free_blocks == 0


def test_reset_forgets_unreferenced_prefixes_and_keeps_the_free_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(list(range(9)), "a")  # blocks 0, 1 full; 2 partial
    b = seq(list(range(100, 109)), "b")  # blocks 3, 4 full; 5 partial
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a)
    assert list(bm.free_queue) == [2, 6, 7, 1, 0]
    assert bm.num_cached_free_blocks == 2

    bm.reset_prefix_cache()
    assert list(bm.free_queue) == [2, 6, 7, 1, 0], "the free blocks keep their order"
    assert bm.num_cached_free_blocks == 0
    assert all(bm.blocks[i].block_hash is None and bm.blocks[i].token_ids is None for i in (0, 1))
    assert bm.cached_blocks == {b.block_hashes[0]: 3, b.block_hashes[1]: 4}, "b is running: it keeps its"
    assert bm.find_cached_prefix(seq(list(range(9)), "a2")).block_ids == []
    assert bm.find_cached_prefix(seq(list(range(100, 109)), "b2")).block_ids == [3, 4]
    c = seq(list(range(200, 209)), "c")
    run_prefill(bm, c)
    assert c.block_table == [2, 6, 7]
