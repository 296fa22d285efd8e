"""A request as the engine tracks it: its tokens, where its KV lives, and its timings."""

import enum
import time
from typing import Any

import torch

from runtime.engine.detokenizer import Detokenizer
from runtime.engine.metrics import RequestMetrics
from runtime.engine.sampling import SamplingParams, make_generator
from runtime.kv.digest import block_digest
from runtime.speculation.adaptive import DraftLength


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        eos_token_ids: list[int],
        device: torch.device,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + generated
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_len = len(prompt_token_ids) + params.max_tokens  # the engine lowers it to what fits
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the pool
        self.block_table: list[int] = []  # logical block -> physical block id
        self.block_hashes: list[bytes] = []  # digest of each full block it holds, in order
        self._digests: list[bytes] = []  # digest of each full block of token_ids, computed once
        self.num_disk_loaded_tokens = 0  # tokens whose KV the disk tier loaded for this request
        self.finish_reason: str | None = None
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        self.generator = make_generator(params, device)
        self.detokenizer = Detokenizer(tokenizer, params.stop, params.include_stop_str_in_output)
        self.metrics = RequestMetrics(num_prompt_tokens=self.num_prompt_tokens)
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.admitted_once = False
        # Tokens a drafter guessed to follow token_ids, scheduled with the next step to be
        # verified; never in token_ids, hashed or cached until the model accepts them.
        self.draft_token_ids: list[int] = []
        self.speculate = "off"  # the drafter guessing for it: "off", "ngram" or "draft"
        self.draft_length: DraftLength | None = None  # how many to guess next (speculating only)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Only the last token lacks KV: the next step computes it (and any guesses after it)."""
        return self.num_computed_tokens == len(self.token_ids) - 1 and not self.is_prefill

    def scheduled_tokens(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end-1 of token_ids followed by the guesses."""
        known = len(self.token_ids)
        if end <= known:
            return self.token_ids[start:end]
        # Slices only: copying the whole history each step would cost O(context) per guess.
        return self.token_ids[start:] + self.draft_token_ids[max(0, start - known) : end - known]

    @property
    def is_prefill(self) -> bool:
        """True while the prompt lacks KV (its last token included) or, after a preemption, tokens
        before the last one do (the recompute); false only for decode, which computes the last
        token alone once it was sampled."""
        return self.num_computed_tokens < max(self.num_prompt_tokens, len(self.token_ids) - 1)

    def block_digest(self, index: int, block_size: int) -> bytes:
        """The chained digest of full block ``index`` of ``token_ids`` (memoized: a full block's
        tokens never change, and admission asks again each step a request waits)."""
        while len(self._digests) <= index:
            i = len(self._digests)
            parent = self._digests[-1] if self._digests else None
            self._digests.append(block_digest(parent, self.token_ids[i * block_size : (i + 1) * block_size]))
        return self._digests[index]

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
            self.metrics.ttft_ms = (now - self.arrival_time) * 1000
        else:
            assert self.last_token_time is not None
            self.metrics.inter_token_ms.append((now - self.last_token_time) * 1000)
            self.metrics.decode_ms = (now - self.first_token_time) * 1000
        self.last_token_time = now
        self.metrics.num_generated_tokens = self.num_output_tokens
