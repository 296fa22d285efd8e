"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``). Running sequences go first, in
arrival order: a decoding sequence takes one token, a sequence still prefilling takes as much
of its remaining prompt as the budget allows (chunked prefill). Waiting sequences are then
admitted while budget, sequence slots and free blocks last; admission first reuses the longest
cached prefix, continued from the disk tier where one is given (``load_prefix``). When a running
sequence needs a block and none is free, the most recently admitted running sequence is
preempted: its blocks are freed (they keep their digests, so it usually hits its own prefix when
it returns) and it goes back to the front of the queue to be recomputed. A decoding sequence
carrying guesses (speculative decoding) takes its token and all its guesses, or drops the guesses
when they do not fit the budget or the pool; it never preempts anyone for them.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.engine.sequence import Sequence, SequenceStatus
from runtime.kv.block_manager import BlockManager, PrefixHit


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        load_prefix: Callable[[Sequence, PrefixHit], None] | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.load_prefix = load_prefix  # extends an in-memory hit from the disk tier
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        block_size = self.block_manager.block_size

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = len(seq) - seq.num_computed_tokens
            # Guesses ride along only whole and only where they fit: before preempting anyone
            # for room, a sequence gives up its own guesses.
            if seq.draft_token_ids and (
                num_tokens + len(seq.draft_token_ids) > budget
                or not self.block_manager.allocate_slots(seq, num_tokens + len(seq.draft_token_ids))
            ):
                seq.draft_token_ids = []
            if seq.draft_token_ids:
                num_tokens += len(seq.draft_token_ids)
                batch.add(seq, num_tokens)
                budget -= num_tokens
                i += 1
                continue
            num_tokens = min(num_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_tokens):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.add(seq, num_tokens)
                budget -= num_tokens
                i += 1

        # Admitting while preempting would only evict the sequences just admitted.
        while self.waiting and not batch.preempted and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]
            hit = self.block_manager.find_cached_prefix(seq)
            if self.load_prefix is not None:
                self.load_prefix(seq, hit)
            num_cached = len(hit.block_ids) * block_size
            num_tokens = min(len(seq) - num_cached, budget)
            if not self.block_manager.can_admit(hit, num_cached + num_tokens):
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, hit)
            allocated = self.block_manager.allocate_slots(seq, num_tokens)
            assert allocated, "can_admit promised room that allocate_slots did not find"
            self.block_manager.record_query(len(seq), num_cached)
            if not seq.admitted_once:
                seq.admitted_once = True
                seq.metrics.num_cached_tokens = num_cached
                seq.metrics.num_disk_cached_tokens = min(seq.num_disk_loaded_tokens, num_cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_tokens)
            budget -= num_tokens
        return batch

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
