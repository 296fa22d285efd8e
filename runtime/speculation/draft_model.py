"""A second model guesses: the engine's draft, run by an engine of its own with a small KV pool.

The draft must share the model's tokenizer (checked at load: the same vocabulary, token for
token), since its guesses are token ids the model verifies. The default draft is the model
itself in a cheaper weight format (``draft_weights``, int4): it guesses the precise format's
tokens most of the time at a good part of the cheap format's speed.

Each proposal is a greedy generation of ``k`` tokens from the sequence's tokens so far. The
draft engine caches prefixes in blocks of ``DRAFT_BLOCK_SIZE`` tokens, and what the model
accepted is what the draft generated, so a proposal recomputes only the last few tokens of the
context before decoding its guesses.

The int4 kernels are made for a few rows; a long prompt through them costs several times the
target's own prefill. So a draft that is the target model in another format reads long chunks
(a new request's prompt) with the target's forward when both compute in the same dtype: the
draft's KV for the prompt is then the precise model's, which only makes its guesses closer.
"""

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import Any

from runtime.engine.sampling import SamplingParams
from runtime.engine.sequence import Sequence
from runtime.errors import DraftModelError, EngineError

DRAFT_BLOCK_SIZE = 4  # small: a proposal recomputes up to this many context tokens
DRAFT_KV_POOL = "256MiB"


class DraftModelDrafter:
    def __init__(self, target: Any, make_engine: Callable[..., Any]) -> None:
        """``target``: the engine this drafts for; ``make_engine``: the Engine class. Both are
        handed in (and typed loosely) so this module never imports the engine that imports it."""
        config = target.config
        path = config.draft_model if config.draft_model is not None else target.model_path
        try:
            self.engine = make_engine(
                path,
                weights=config.draft_weights,
                device=config.device,
                kv_pool=DRAFT_KV_POOL,
                block_size=DRAFT_BLOCK_SIZE,
                max_num_seqs=max(1, config.speculate_max_batch),
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=target.max_model_len,
                gemm=config.gemm,
                speculate="off",
            )
        except (EngineError, ValueError) as exc:
            raise DraftModelError(f"the draft model {path}: {exc}") from exc
        ours = target.tokenizer.get_vocab()
        theirs = self.engine.tokenizer.get_vocab()
        if ours != theirs:
            raise DraftModelError(
                f"the draft model {self.engine.model_path} has another vocabulary ({len(theirs)} tokens "
                f"against the model's {len(ours)}); a draft must share the model's tokenizer"
            )

        same_model = config.draft_model is None
        runner, target_runner = self.engine.runner, target.runner
        if (
            same_model
            and target.dtype == self.engine.dtype
            and runner.lean_forward is not None
            and target_runner.lean_forward is not None
        ):
            runner.prefill_forward = target_runner.lean_forward
            # Long chunks go to the target's forward: the draft's own bfloat16 copies for them
            # would be a second copy of the model's weights.
            runner.lean_forward.release_wide_copies()

    def propose(self, seqs: SequenceOf[Sequence], num_tokens: SequenceOf[int]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in num_tokens]
        try:
            completions = self.engine.generate([list(seq.token_ids) for seq in seqs], params)
        except EngineError:
            return [[] for _ in seqs]  # (a context the draft's pool cannot hold: no guess)
        return [c.token_ids for c in completions]

    def forget(self, seq: Sequence) -> None:
        pass  # the draft engine's prefix cache evicts what is no longer asked for

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        self.engine.close()
