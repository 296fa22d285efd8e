"""The scheduler on real sequences and a real block manager, no model: which sequences run in a
step and how many tokens each, asserted exactly, step by step.

``advance`` does what the engine does after a forward: the scheduled tokens get KV, full blocks
are sealed, and a sequence that reached the end of its known tokens samples one more.
"""

import time

import torch

from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from runtime.engine.sequence import Sequence, SequenceStatus
from runtime.kv.block_manager import BlockManager

BS = 4
SAMPLED = 7  # the token every step "samples"


def seq(rid: str, num_tokens: int, first: int = 100) -> Sequence:
    tokens = list(range(first, first + num_tokens))
    return Sequence(rid, tokens, SamplingParams(max_tokens=16), None, [], torch.device("cpu"))


def scheduler(num_blocks: int, budget: int = 512, max_num_seqs: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, BlockManager(num_blocks, BS))


def advance(s: Scheduler, batch: ScheduledBatch) -> None:
    """What the engine does with a batch after its forward."""
    assert sum(batch.num_new_tokens) <= s.config.max_num_batched_tokens
    for sq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        sq.num_computed_tokens += num_new
        s.block_manager.seal_full_blocks(sq)
        if sq.num_computed_tokens == len(sq):
            sq.append_token(SAMPLED, time.perf_counter())


def step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule and advance one step; the batch as (request id, tokens)."""
    batch = s.schedule()
    advance(s, batch)
    return [(sq.request_id, n) for sq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]


def ids(seqs: object) -> list[str]:
    return [sq.request_id for sq in seqs]  # type: ignore[attr-defined]


def test_waiting_sequences_fill_the_token_budget_in_arrival_order() -> None:
    s = scheduler(num_blocks=16, budget=10)
    for rid in "abc":
        s.add(seq(rid, 4, first=100 * (ord(rid) - 96)))
    assert step(s) == [("a", 4), ("b", 4), ("c", 2)]  # c gets what is left: a chunk of 2
    assert ids(s.running) == ["a", "b", "c"] and not s.waiting
    # Running sequences go first: a and b decode, c finishes its prompt.
    assert step(s) == [("a", 1), ("b", 1), ("c", 2)]
    assert step(s) == [("a", 1), ("b", 1), ("c", 1)]


def test_chunked_prefill_splits_a_prompt_at_the_budget() -> None:
    s = scheduler(num_blocks=16, budget=8)
    a, b = seq("a", 23), seq("b", 6, first=300)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 8)]  # b waits: the budget is spent
    assert step(s) == [("a", 8)]
    assert step(s) == [("a", 7), ("b", 1)]  # the last chunk, and b's first chunk from what is left
    assert len(a) == 24 and a.num_computed_tokens == 23
    assert step(s) == [("a", 1), ("b", 5)]
    assert step(s) == [("a", 1), ("b", 1)]
    # Blocks are taken as the tokens arrive: b's came between a's sixth block and its seventh.
    assert a.block_table == [0, 1, 2, 3, 4, 5, 8] and b.block_table == [6, 7]


def test_admission_is_first_come_first_served_even_when_a_later_one_would_fit() -> None:
    s = scheduler(num_blocks=4)
    s.add(seq("a", 9))  # 3 blocks
    assert step(s) == [("a", 9)]
    s.add(seq("b", 9, first=200))  # 3 blocks: does not fit in the 1 left
    s.add(seq("c", 3, first=300))  # 1 block: would fit, but must not overtake b
    assert step(s) == [("a", 1)]
    assert ids(s.waiting) == ["b", "c"]
    assert s.block_manager.num_free_blocks == 1


def test_admission_stops_at_max_num_seqs() -> None:
    s = scheduler(num_blocks=16, max_num_seqs=2)
    for rid in "abc":
        s.add(seq(rid, 3, first=100 * (ord(rid) - 96)))
    assert step(s) == [("a", 3), ("b", 3)]
    assert ids(s.waiting) == ["c"]
    s.finish(s.running[0], "stop")
    assert step(s) == [("b", 1), ("c", 3)]


def test_the_most_recently_admitted_sequence_is_preempted_when_blocks_run_out() -> None:
    s = scheduler(num_blocks=6)
    a, b, c = seq("a", 7), seq("b", 7, first=200), seq("c", 7, first=300)
    for sq in (a, b, c):
        s.add(sq)
    assert step(s) == [("a", 7), ("b", 7), ("c", 7)]  # 2 blocks each: the pool is full
    assert step(s) == [("a", 1), ("b", 1), ("c", 1)]  # position 7 still fits in block 2 of each
    assert s.block_manager.num_free_blocks == 0
    # Position 8 needs a third block. a asks first; c, the last admitted, gives up its two
    # (freed tail first, so its block 5 goes before its block 4): a takes 5, b takes 4.
    assert step(s) == [("a", 1), ("b", 1)]
    assert a.block_table == [0, 1, 5] and b.block_table == [2, 3, 4]
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert ids(s.running) == ["a", "b"] and ids(s.waiting) == ["c"]
    assert c.metrics.num_preemptions == 1 and s.num_preemptions == 1
    assert step(s) == [("a", 1), ("b", 1)]  # no room for c yet
    s.finish(a, "stop")
    # c comes back first in line; its blocks were reused, so it recomputes all 9 known tokens.
    assert step(s) == [("b", 1), ("c", 9)]
    assert c.block_table == [5, 1, 0] and c.metrics.num_cached_tokens == 0


def test_a_sequence_that_is_the_last_admitted_preempts_itself() -> None:
    s = scheduler(num_blocks=4)
    a, b = seq("a", 7), seq("b", 8, first=200)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 7), ("b", 8)]  # 2 blocks each: the pool is full
    # a's position 7 fits its block 1; b's position 8 needs a third block, and b is the victim.
    batch = s.schedule()
    assert ids(batch.seqs) == ["a"] and batch.num_new_tokens == [1]
    assert ids(batch.preempted) == ["b"] and ids(s.waiting) == ["b"]
    assert list(s.block_manager.free_queue) == [3, 2]  # b's full blocks, tail first
    advance(s, batch)
    # a's position 8 takes b's block 3; b hits its block 2 but cannot get the two more it needs.
    assert step(s) == [("a", 1)]
    assert a.block_table == [0, 1, 3] and ids(s.waiting) == ["b"]


def test_has_unfinished_until_every_sequence_is_finished() -> None:
    s = scheduler(num_blocks=4)
    assert not s.has_unfinished()
    a = seq("a", 3)
    s.add(a)
    assert s.has_unfinished()
    step(s)
    s.finish(a, "stop")
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 4
