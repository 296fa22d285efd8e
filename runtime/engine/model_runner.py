"""Turns a scheduled batch into one model forward and returns the logits to sample from.

All scheduled tokens are packed into a single ``(1, T)`` row with explicit ``position_ids``;
the attention hook learns where each sequence starts and ends from :class:`AttentionMetadata`.
Logits are computed only at each sequence's last token, and only for sequences that reach
the end of their known tokens in this step (a prefill chunk that stops mid-prompt samples
nothing); a sequence carrying guesses (speculative decoding) gets a row for its last verified
token and one per guess, scored like a short prefill chunk. Before the forward the runner tells
the KV cache a step begins (:meth:`KVCache.begin_step`), so a quantized cache plans the step's
writes once for every layer.

A decode step (every sequence computes its next token, and any guesses after it) runs the
compiled decode graph of its bucket of rows when the engine asked for one
(``runtime/layers/compiled_step.py``); any other step, and every step after compiling failed,
runs the forward eagerly.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.engine.scheduler import ScheduledBatch
from runtime.engine.sequence import Sequence
from runtime.kv.cache import KVCache
from runtime.layers.attention import METADATA_KWARG, AttentionMetadata, DecodeBatch, PrefillSpan
from runtime.layers.compiled_step import CompiledDecodeStep, StepRows
from runtime.layers.llama_forward import LlamaFamilyForward, supports

# Chunks longer than this run through ``prefill_forward`` where one is given.
PREFILL_FORWARD_ROWS = 32


@dataclass(slots=True)
class StepOutput:
    sampling_seqs: list[Sequence]  # the sequences whose logits are returned, in order
    logits: torch.Tensor | None  # (sum(num_rows), V) float32
    # Rows per sampling sequence: 1, or 1 + its guesses (the last verified token's row, then one
    # per guess), which the engine verifies.
    num_rows: list[int]
    # A step of decode and verification rows only: its (sequences, query rows) as it ran
    # (``step_shape``), the key its cost is measured under; None for a step with prefill rows.
    shape: tuple[int, int] | None = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: torch.device,
        forward: str = "auto",
        gemm: str = "auto",
        weights: str | None = None,
        compile_decode: bool = False,
        max_num_seqs: int = 1,
        on_notice: Callable[[str], None] | None = None,
        max_verify_seqs: int = 0,
        max_query: int = 1,
    ) -> None:
        """``compile_decode``: run pure-decode steps through compiled graphs (the engine checked
        that the lean forward applies and that ``kv_cache`` has a scratch slot), and
        verification steps of up to ``max_verify_seqs`` sequences of ``max_query`` tokens."""
        self.model = model
        # The lean forward where it reproduces the model exactly; transformers' own otherwise.
        # ``weights`` (a weight format) is the lean forward's; the engine has checked it applies.
        self.lean_forward: LlamaFamilyForward | None = None
        if forward == "auto" and supports(model):
            self.lean_forward = LlamaFamilyForward(model, tune_gemm=gemm == "auto", weights=weights)
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device

        # Another forward of the same model for long chunks (prefill): a draft engine in int4
        # reads a long prompt with its target's bfloat16 weights (runtime/speculation/draft_model.py).
        self.prefill_forward: LlamaFamilyForward | None = None
        self._block_offsets = torch.arange(self.block_size, device=device)
        self.compiled_step: CompiledDecodeStep | None = None
        if compile_decode and self.lean_forward is not None:
            self.compiled_step = CompiledDecodeStep(
                self.lean_forward, kv_cache, max_num_seqs, on_notice, max_verify_seqs, max_query
            )

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs = self.block_size
        table = seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _context_slots(self, seq: Sequence, end: int) -> torch.Tensor:
        """Slots of the sequence's first ``end`` tokens, (end,)."""
        num_blocks = -(-end // self.block_size)
        table = torch.tensor(seq.block_table[:num_blocks], device=self.device)
        return (table[:, None] * self.block_size + self._block_offsets).flatten()[:end]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        if self.compiled_step is not None and self.compiled_step.enabled:
            compiled = self._execute_compiled(self.compiled_step, batch)
            if compiled is not None:
                return compiled
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_index: list[int] = []
        decode_slots: list[torch.Tensor] = []
        keep: list[int] = []
        sampling: list[Sequence] = []
        num_rows: list[int] = []

        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + num_new
            query_start = len(input_ids)
            input_ids.extend(seq.scheduled_tokens(start, end))
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(seq, start, end))
            if num_new == 1 and start > 0:
                decode_index.append(query_start)
                decode_slots.append(self._context_slots(seq, end))
            elif start == 0:
                prefills.append(PrefillSpan(query_start, query_start + num_new, None, None))
            else:
                context = self._context_slots(seq, end)
                mask = torch.ones(num_new, end, dtype=torch.bool, device=self.device).tril(diagonal=start)
                prefills.append(PrefillSpan(query_start, query_start + num_new, context, mask))
            num_guesses = len(seq.draft_token_ids)
            if end == len(seq) + num_guesses:
                rows = 1 + num_guesses
                keep.extend(range(query_start + num_new - rows, query_start + num_new))
                sampling.append(seq)
                num_rows.append(rows)

        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slot_mapping, device=self.device),
            prefills=prefills,
            decode=self._decode_batch(decode_index, decode_slots),
        )
        ids = torch.tensor([input_ids], device=self.device)  # (1, T)
        pos = torch.tensor([positions], device=self.device)  # (1, T)
        keep_index = torch.tensor(keep, dtype=torch.long, device=self.device)
        logits = self.forward(ids[0], pos[0], meta, keep_index)  # (n, V)
        # Run eager, so its own numbers (where a graph held it, it ran compiled above).
        shape = (len(sampling), max(num_rows)) if not prefills and len(sampling) == len(batch.seqs) else None
        return StepOutput(sampling, logits.float() if sampling else None, num_rows, shape)

    def step_shape(self, num_seqs: int, query: int) -> tuple[int, int]:
        """The (sequences, query rows) a decode step of ``num_seqs`` sequences with up to
        ``query`` rows each runs as: its compiled graph's bucket, or those numbers eager."""
        step = self.compiled_step
        if step is not None and step.enabled:
            bucket = step.bucket_for(num_seqs, query)
            if bucket is not None:
                return bucket
        return (num_seqs, query)

    @property
    def num_compilations(self) -> int:
        """Graphs compiled so far: a step during which this grew paid for a compile."""
        return 0 if self.compiled_step is None else self.compiled_step.num_compilations

    def _execute_compiled(self, step: CompiledDecodeStep, batch: ScheduledBatch) -> StepOutput | None:
        """A decode batch through its bucket's graph; None for any other step (or no graph).

        A sequence carrying guesses becomes one query row per token it computes (its last
        verified token, then each guess) over its one context, each row masked to its own
        position: the graph writes every row's K/V before any row reads, so a guess sees the
        ones before it, exactly as the eager verification's causal span does.
        """
        rows: list[StepRows] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            if num_new != 1 + len(seq.draft_token_ids) or start == 0 or start + 1 != len(seq):
                return None
            end = start + num_new
            rows.append(
                StepRows(
                    seq.scheduled_tokens(start, end),
                    list(range(start, end)),
                    self._slots(seq, start, end),
                    self._context_slots(seq, end),
                )
            )
        inputs = step.pad(rows)
        if inputs is None:
            return None
        logits = step(inputs)  # (S*Q, V) float32
        if logits is None:
            return None
        num_seqs, query = inputs.context_mask.shape[:2]
        return StepOutput(
            list(batch.seqs), inputs.real_rows(logits), [len(r.input_ids) for r in rows], (num_seqs, query)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor,
        decode_kernels: bool = False,
    ) -> torch.Tensor:
        """Logits (len(keep), V) at packed positions ``keep``, in the model's dtype; ids, positions: (T,).

        ``decode_kernels``: multiply as decode steps do, however many rows (no bfloat16 copies of
        quantized weights, no other forward for long chunks), to score the weight format itself.
        """
        self.kv_cache.begin_step(meta.slot_mapping)
        long_chunk = input_ids.shape[0] > PREFILL_FORWARD_ROWS
        if self.prefill_forward is not None and long_chunk and not decode_kernels:
            return self.prefill_forward(input_ids, position_ids, meta, keep)
        if self.lean_forward is not None:
            return self.lean_forward(input_ids, position_ids, meta, keep, decode_kernels)
        out = self.model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            use_cache=False,
            logits_to_keep=keep,
            **{METADATA_KWARG: meta},
        )
        return out.logits[0]

    def _decode_batch(self, index: list[int], slots: list[torch.Tensor]) -> DecodeBatch | None:
        if not index:
            return None
        lengths = [len(s) for s in slots]
        max_len = max(lengths)
        mask = None
        if min(lengths) != max_len:
            length = torch.tensor(lengths, device=self.device)
            mask = torch.arange(max_len, device=self.device)[None, :] < length[:, None]  # (B, L)
            mask = mask[:, None, None, :]  # (B, 1, 1, L)
        # Padding points at slot 0; the mask keeps it out of the softmax.
        padded = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)  # (B, L)
        return DecodeBatch(
            query_index=torch.tensor(index, device=self.device), context_slots=padded, mask=mask
        )
