"""The engine: requests in, tokens out, KV memory accounted for.

``Engine`` owns the model, the KV pool, the block manager and the scheduler, and advances all
live requests together one :meth:`Engine.step` at a time. Callers normally use
:meth:`generate` (a list of prompts, run as one continuous batch) or :meth:`stream` (one prompt,
deltas as they are produced). Both are safe to call from several threads at once: whichever
caller holds the step lock advances every request and hands each output to its owner's queue,
so concurrent streams share forward passes without a background thread.
"""

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.engine.config import SPECULATE_AUTO_FORMATS, EngineConfig
from runtime.engine.metrics import EngineStats, RequestMetrics
from runtime.engine.model_runner import ModelRunner, StepOutput
from runtime.engine.sampling import SamplingParams, sample
from runtime.engine.scheduler import Scheduler
from runtime.engine.sequence import Sequence, SequenceStatus
from runtime.engine.weight_plan import TRIAL_OPTIONS, weight_plan
from runtime.errors import ModelError, PoolTooSmallError, PromptTooLongError
from runtime.kv.block_manager import BlockManager
from runtime.kv.cache import KVCache, KVLayout, num_blocks_for
from runtime.kv.disk_prefix import DiskPrefixCache
from runtime.layers.attention import ATTENTION_NAME, AttentionMetadata, PrefillSpan, paged_attention_forward
from runtime.layers.llama_forward import supports as supports_lean_forward
from runtime.layers.llama_forward import supports_config as supports_lean_forward_config
from runtime.layers.weights import ACTIVATION_DTYPE, QUANTIZED_FORMATS, dtype_for
from runtime.models.loader import load_model, resolve_device, resolve_model
from runtime.sizes import format_bytes
from runtime.speculation.adaptive import DraftLength, plan_query
from runtime.speculation.drafter import Drafter
from runtime.speculation.ngram import NgramDrafter
from runtime.speculation.step_costs import StepCosts
from runtime.speculation.verify import verify_greedy, verify_sampled

Prompt = str | list[int]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CompletionDelta:
    """What one request produced in one step. ``metrics`` is set on the last delta only."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None


@dataclass(slots=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics


class Engine:
    def __init__(
        self,
        model: str | Path = "smollm2-135m-instruct",
        *,
        on_notice: Callable[[str], None] | None = None,
        **options: Any,
    ) -> None:
        """``on_notice`` hears the lines worth a user's attention that are not errors (a decode
        graph compiling, compiling falling back to eager); None logs them at INFO."""
        self.config = EngineConfig(model=model, **options)
        weights = self.config.weights
        if weights == "auto":
            weights = self._auto_weights(on_notice or log.info)
        loaded = load_model(
            self.config.model, dtype=dtype_for(weights, self.config.dtype), device=self.config.device
        )
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.path
        self.device = loaded.device
        self.eos_token_ids = loaded.eos_token_ids
        quantized = weights in QUANTIZED_FORMATS
        if quantized and self.device.type != "cpu":
            raise ModelError(
                f"{weights} weights run on the CPU only; use --weights auto on {self.device.type}"
            )
        if quantized and not supports_lean_forward(self.model):
            raise ModelError(f"{weights} weights need a Llama-family model; {self.model_path} is not one")
        # The activations' (and the auto KV's) dtype: quantized formats compute in bfloat16.
        self.dtype = ACTIVATION_DTYPE if quantized else loaded.dtype
        self.weight_format = weights if weights != "auto" else str(loaded.dtype).removeprefix("torch.")

        cfg = self.model.config
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
            raise ModelError(f"{self.model_path}: sliding-window attention layers are not supported yet")
        self.max_model_len: int = self.config.max_model_len or int(
            getattr(cfg, "max_position_embeddings", 4096)
        )
        layout = KVLayout(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            dtype=self.dtype,
            block_size=self.config.block_size,
            k_dtype=self.config.k_dtype or "auto",
            v_dtype=self.config.v_dtype or "auto",
        )
        pool_bytes = self.config.kv_pool_bytes(self.device)
        num_blocks = num_blocks_for(pool_bytes, layout.bytes_per_token, self.config.block_size)
        if num_blocks < 1:
            raise PoolTooSmallError(
                f"a KV pool of {format_bytes(pool_bytes)} cannot hold one block of {self.config.block_size} "
                f"tokens ({format_bytes(layout.bytes_per_token * self.config.block_size)}); raise --kv-pool"
            )
        # A quantized pool's reads plan and dequantize in Python, and transformers' own forward
        # has no graph to compile: both stay eager.
        self.compile_decode = (
            self.config.compile
            and not layout.quantized
            and self.config.forward == "auto"
            and supports_lean_forward(self.model)
        )
        self.kv_cache = KVCache(
            layout, num_blocks, self.config.block_size, self.device, scratch_block=self.compile_decode
        )
        self.block_manager = BlockManager(
            num_blocks, self.config.block_size, self.config.enable_prefix_caching, self.kv_cache.release
        )
        self.disk_cache = self._open_disk_cache(layout)
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.block_manager,
            self.disk_cache.extend_hit if self.disk_cache is not None else None,
        )

        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        self.model.config._attn_implementation = ATTENTION_NAME
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            self.device,
            self.config.forward,
            self.config.gemm,
            self.weight_format,
            compile_decode=self.compile_decode,
            max_num_seqs=self.config.max_num_seqs,
            on_notice=on_notice or log.info,
            # A verification step: a sequence's last token and each of its guesses.
            max_verify_seqs=min(self.config.speculate_max_batch, self.config.max_num_seqs),
            max_query=1 + self.config.num_draft_tokens,
        )

        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._queues: dict[str, queue.SimpleQueue[CompletionDelta]] = {}
        self._state_lock = threading.Lock()  # guards the scheduler's queues and _seqs
        self._step_lock = threading.Lock()  # one caller advances the engine at a time
        # Callers that find the engine busy sleep on this until the running step ends, rather
        # than polling: N polling threads would take the GIL from the one doing the work.
        self._stepped = threading.Condition()
        self._num_steps = 0
        self._max_batch_size = 0
        # Speculative decoding: drafters by name, the draft model's built on first use.
        self._drafters: dict[str, Drafter] = {"ngram": NgramDrafter()}
        self._spec_num_drafts = 0
        self._spec_num_draft_tokens = 0
        self._spec_num_accepted_tokens = 0
        # Each decode/verification shape's measured wall time, which guesses must repay.
        self.step_costs = StepCosts()
        # The default drafter of requests that do not choose one ("auto" resolved).
        self.speculate = self.config.speculate
        if self.speculate == "auto":
            self.speculate = "ngram" if self.weight_format in SPECULATE_AUTO_FORMATS else "off"
        if self.speculate == "draft":
            self._drafter("draft")

    def _auto_weights(self, on_notice: Callable[[str], None]) -> str:
        """``weights="auto"``: the weight plan's measured choice (weight_plan.py) where nothing else
        decides (dtype auto, the lean forward, a CPU); "auto" (the dtype's float weights) elsewhere."""
        config = self.config
        if config.dtype != "auto" or config.forward != "auto" or resolve_device(config.device).type != "cpu":
            return "auto"
        path = resolve_model(config.model)
        try:
            from transformers import AutoConfig

            lean = supports_lean_forward_config(AutoConfig.from_pretrained(path))
        except (OSError, ValueError, KeyError):
            return "auto"  # load_model below says what is wrong with the model
        if not lean:
            return "auto"

        def trial(fmt: str, tune_gemm: bool) -> "Engine":
            return Engine(path, weights=fmt, gemm="auto" if tune_gemm else "torch", **TRIAL_OPTIONS)

        return weight_plan(path, trial, on_notice).choice

    def _open_disk_cache(self, layout: KVLayout) -> DiskPrefixCache | None:
        """The disk tier under the prefix cache, filed under a fingerprint of what the numbers
        depend on; None when it is off (kv_disk 0, or no prefix caching)."""
        if not self.config.kv_disk or not self.config.enable_prefix_caching:
            return None
        from runtime.kv.disk_tier import DiskTier, default_root, fingerprint

        numbers = {
            "dtype": self.dtype,
            "weights": self.weight_format,
            "k_dtype": layout.k_dtype,
            "v_dtype": layout.v_dtype,
            "block_size": layout.block_size,
            "forward": self.config.forward,
            "gemm": self.config.gemm,
            "device": self.device.type,
        }
        root = Path(self.config.kv_disk_dir) if self.config.kv_disk_dir is not None else default_root()
        tier = DiskTier(
            root, fingerprint(self.model_path, numbers), int(self.config.kv_disk), layout.bytes_per_block
        )
        disk_cache = DiskPrefixCache(tier, self.block_manager, self.kv_cache)
        self.block_manager.on_evict = disk_cache.save_evicted
        return disk_cache

    def _drafter(self, name: str) -> Drafter:
        drafter = self._drafters.get(name)
        if drafter is None:
            from runtime.speculation.draft_model import DraftModelDrafter

            drafter = self._drafters[name] = DraftModelDrafter(self, Engine)
        return drafter

    def close(self) -> None:
        """Flush the disk tier's pending writes (bounded to a couple of seconds) and stop its writer."""
        if self.disk_cache is not None:
            self.disk_cache.tier.close()

    # -- requests -----------------------------------------------------------------------------

    @property
    def pool_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.config.block_size

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        params = params or SamplingParams()
        token_ids = self.encode(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; the model's context is {self.max_model_len}"
            )
        if len(token_ids) > self.pool_capacity_tokens:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; the KV pool holds {self.pool_capacity_tokens} "
                f"({format_bytes(self.stats().kv_pool_bytes)}); raise --kv-pool"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        seq = Sequence(request_id, token_ids, params, self.tokenizer, self.eos_token_ids, self.device)
        # The last generated token never needs KV, hence the +1 on the pool's capacity.
        seq_limit = min(len(token_ids) + params.max_tokens, self.max_model_len, self.pool_capacity_tokens + 1)
        seq.max_len = seq_limit
        seq.speculate = params.speculate or self.speculate
        if seq.speculate != "off":
            self._drafter(seq.speculate)  # a draft model that cannot load fails the request here
            seq.draft_length = DraftLength(params.num_draft_tokens or self.config.num_draft_tokens)
        with self._state_lock:
            if request_id in self._seqs:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._seqs[request_id] = seq
            self._queues[request_id] = queue.SimpleQueue()
            self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; its stream ends with finish_reason 'abort'."""
        with self._step_lock, self._state_lock:
            seq = self._seqs.get(request_id)
            if seq is None or seq.is_finished:
                return
            self._save_to_disk(seq)
            self._retire(seq, "abort")
            self._deliver(seq, [], final=True)

    # -- stepping -----------------------------------------------------------------------------

    def step(self) -> list[CompletionDelta]:
        """Run one forward over the scheduled batch; return each affected request's delta."""
        # A step's cost, as guesses must repay it, includes proposing them (a draft model's forwards).
        started = time.perf_counter()
        self._propose_drafts()
        with self._state_lock:
            batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        now = time.perf_counter()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                seq.metrics.queue_ms = (now - seq.arrival_time) * 1000
        self._max_batch_size = max(self._max_batch_size, len(batch.seqs))

        compilations = self.runner.num_compilations
        output = self.runner.execute(batch)
        next_tokens = self._next_tokens(output)  # (its token ids on the host: the step is done)
        now = time.perf_counter()
        if output.shape is not None and self.runner.num_compilations == compilations:
            self.step_costs.observe(output.shape, now - started)

        deltas: list[CompletionDelta] = []
        with self._state_lock:
            for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
                if seq.is_prefill:
                    seq.metrics.num_prefilled_tokens += num_new
                # A sequence's guesses count once verified (_settle_drafts).
                seq.num_computed_tokens += num_new - len(seq.draft_token_ids)
                if not seq.draft_token_ids:
                    self.kv_cache.seal(self.block_manager.seal_full_blocks(seq))
            for seq, tokens in zip(output.sampling_seqs, next_tokens, strict=True):
                if seq.first_token_time is None and seq.first_scheduled_time is not None:
                    seq.metrics.prefill_ms = (now - seq.first_scheduled_time) * 1000
                emitted: list[int] = []
                reason = None
                for token in tokens:
                    seq.append_token(token, now)
                    emitted.append(token)
                    reason = self._finish_reason(seq, token)
                    if reason is not None:
                        break
                if seq.draft_token_ids:
                    self._settle_drafts(seq, num_accepted=len(tokens) - 1)
                if reason is not None:
                    self._save_to_disk(seq)
                    self._retire(seq, reason)
                deltas.append(self._deliver(seq, emitted, final=reason is not None))
        return deltas

    # -- speculative decoding -----------------------------------------------------------------

    def _propose_drafts(self) -> None:
        """Let each speculating sequence that decodes next guess what follows, batch permitting.

        Runs under the step lock but outside the state lock (a draft model's proposal is a few
        forwards): only stepping changes a running sequence's tokens, and only this thread steps.
        """
        with self._state_lock:
            running = list(self.scheduler.running)
        if len(running) > self.config.speculate_max_batch:
            return
        # Each speculating sequence's most guesses, then the step's: what its measured cost repays.
        most: dict[Sequence, tuple[int, float]] = {}  # (most guesses, acceptance)
        for seq in running:
            if seq.speculate == "off" or seq.draft_length is None or not seq.is_decoding:
                continue
            most[seq] = (min(seq.draft_length.current, self._draft_room(seq)), seq.draft_length.acceptance)
        if not any(k for k, _ in most.values()):
            return
        num_seqs = len(running)
        plans = [most.get(seq, (0, 0.0)) for seq in running]
        query = plan_query(
            [k for k, _ in plans],
            [a for _, a in plans],
            lambda q: self.step_costs.estimate(self.runner.step_shape(num_seqs, q)),
        )
        wanted: dict[str, tuple[list[Sequence], list[int]]] = {}
        for seq, (k, _) in most.items():
            k = min(k, query - 1)
            if k >= 1:
                seqs, ks = wanted.setdefault(seq.speculate, ([], []))
                seqs.append(seq)
                ks.append(k)
        for name, (seqs, ks) in wanted.items():
            for seq, k, guess in zip(seqs, ks, self._drafters[name].propose(seqs, ks), strict=True):
                seq.draft_token_ids = list(guess[:k])

    def _draft_room(self, seq: Sequence) -> int:
        """Most guesses ``seq`` may carry: all accepted plus the model's own token stay within its
        length limit, and in a quantized pool no guess lands on a block's last slot (writing that
        slot quantizes the block, which must hold verified tokens only)."""
        room = seq.max_len - len(seq) - 1
        if self.kv_cache.layout.quantized:
            bs = self.config.block_size
            offset = (len(seq) - 1) % bs  # the last verified token's slot in its block
            room = min(room, bs - 2 - offset if offset < bs - 1 else bs - 1)
        return max(0, room)

    def _next_tokens(self, output: StepOutput) -> list[list[int]]:
        """Per sampling sequence, the tokens this step adds: one sampled token, or the guesses
        the model accepts followed by its own next token."""
        if output.logits is None:
            return []
        if all(n == 1 for n in output.num_rows):
            seqs = output.sampling_seqs
            sampled = sample(output.logits, [s.params for s in seqs], [s.generator for s in seqs])
            return [[token] for token in sampled]
        result: list[list[int]] = []
        row = 0
        for seq, n in zip(output.sampling_seqs, output.num_rows, strict=True):
            rows = output.logits[row : row + n]
            row += n
            drafts = seq.draft_token_ids
            if not drafts:
                result.append(sample(rows, [seq.params], [seq.generator]))
            elif seq.params.greedy:
                result.append(verify_greedy(rows, drafts))
            else:
                result.append(verify_sampled(rows, drafts, seq.params, seq.generator))
        return result

    def _settle_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the accepted guesses' KV counts, the rejected ones' slots go back
        (whole blocks past the new end return to the pool), full blocks are sealed, and the
        metrics and the next guess's length learn from the outcome."""
        num_drafted = len(seq.draft_token_ids)
        seq.draft_token_ids = []
        # The accepted guesses' KV is valid; a stop inside them ends the sequence earlier.
        seq.num_computed_tokens = min(seq.num_computed_tokens + num_accepted, len(seq) - 1)
        self.block_manager.trim(seq, seq.num_computed_tokens)
        self.kv_cache.seal(self.block_manager.seal_full_blocks(seq))
        seq.metrics.num_drafts += 1
        seq.metrics.num_draft_tokens += num_drafted
        seq.metrics.num_accepted_tokens += num_accepted
        self._spec_num_drafts += 1
        self._spec_num_draft_tokens += num_drafted
        self._spec_num_accepted_tokens += num_accepted
        if seq.draft_length is not None:
            seq.draft_length.update(num_drafted, num_accepted)

    def _retire(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        for drafter in self._drafters.values():
            drafter.forget(seq)

    def _save_to_disk(self, seq: Sequence) -> None:
        if self.disk_cache is not None and seq.block_table:
            self.disk_cache.save_sequence(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        stopped_by_string = seq.detokenizer.add_token(token) if token not in seq.stop_token_ids else False
        if token in seq.stop_token_ids or stopped_by_string:
            return "stop"
        if len(seq) >= seq.max_len:
            return "length"
        return None

    def _deliver(self, seq: Sequence, token_ids: list[int], final: bool) -> CompletionDelta:
        delta = CompletionDelta(
            request_id=seq.request_id,
            token_ids=token_ids,
            text=seq.detokenizer.take_delta(final=final),
            finished=final,
            finish_reason=seq.finish_reason if final else None,
            metrics=seq.metrics if final else None,
        )
        owner = self._queues.get(seq.request_id)
        if owner is not None:
            owner.put(delta)
        if final:
            self._seqs.pop(seq.request_id, None)
        return delta

    def _advance(self) -> None:
        """Step the engine if no other caller is doing so; otherwise wait for that caller's step."""
        seen = self._num_steps
        if self._step_lock.acquire(blocking=False):
            try:
                self.step()
            finally:
                self._step_lock.release()
                with self._stepped:
                    self._num_steps += 1
                    self._stepped.notify_all()
        else:
            with self._stepped:
                # The timeout only bounds a wait on a step that was aborted or raised.
                self._stepped.wait_for(lambda: self._num_steps != seen, timeout=0.05)

    # -- front doors --------------------------------------------------------------------------

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Generator[CompletionDelta, None, None]:
        request_id = self.add_request(prompt, params, request_id)
        inbox = self._queues[request_id]
        finished = False
        try:
            while True:
                try:
                    delta = inbox.get_nowait()
                except queue.Empty:
                    self._advance()
                    continue
                if delta.finished:
                    finished = True
                yield delta
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._queues.pop(request_id, None)

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run prompts as one continuous batch; results in the order of the prompts."""
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]  # one prompt: text or token ids
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if isinstance(params, SequenceOf):
            param_list = list(params)
        else:
            param_list = [params or SamplingParams()] * len(prompt_list)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} sampling params")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompt_list, param_list, strict=True):
                ids.append(self.add_request(prompt, p))
            prompt_ids = {rid: list(self._seqs[rid].token_ids) for rid in ids}
            tokens: dict[str, list[int]] = {rid: [] for rid in ids}
            texts: dict[str, list[str]] = {rid: [] for rid in ids}
            done: dict[str, CompletionDelta] = {}
            while len(done) < len(ids):
                progressed = False
                for rid in ids:
                    if rid in done:
                        continue
                    inbox = self._queues[rid]
                    while not inbox.empty():
                        delta = inbox.get_nowait()
                        progressed = True
                        tokens[rid].extend(delta.token_ids)
                        texts[rid].append(delta.text)
                        if delta.finished:
                            done[rid] = delta
                if not progressed:
                    self._advance()
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        finally:
            for rid in ids:
                self._queues.pop(rid, None)
        results = []
        for rid in ids:
            last = done[rid]
            assert last.finish_reason is not None and last.metrics is not None
            results.append(
                Completion(
                    rid, prompt_ids[rid], tokens[rid], "".join(texts[rid]), last.finish_reason, last.metrics
                )
            )
        return results

    # -- observation --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        with self._state_lock:
            bm = self.block_manager
            block_size = self.config.block_size
            filled: dict[int, int] = {}
            for seq in self.scheduler.running:
                for i, block_id in enumerate(seq.block_table):
                    used = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
                    filled[block_id] = max(filled.get(block_id, 0), used)
            num_used = bm.num_used_blocks()
            num_cached = bm.num_cached_free_blocks
            return EngineStats(
                block_size=block_size,
                num_blocks_total=bm.num_blocks,
                num_blocks_used=num_used,
                num_blocks_cached=num_cached,
                num_blocks_free=bm.num_free_blocks - num_cached,
                kv_tokens_in_use=sum(filled.values()),
                kv_bytes_in_use=num_used * self.kv_cache.bytes_per_block,
                kv_pool_bytes=bm.num_blocks * self.kv_cache.bytes_per_block,
                bytes_per_token=self.kv_cache.bytes_per_token,
                k_dtype=self.kv_cache.k_dtype,
                v_dtype=self.kv_cache.v_dtype,
                prefix_queried_tokens=bm.num_queried_tokens,
                prefix_hit_tokens=bm.num_hit_tokens,
                prefix_hittable_tokens=bm.num_hittable_tokens,
                num_preemptions=self.scheduler.num_preemptions,
                max_batch_size=self._max_batch_size,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                kv_staging_bytes=self.kv_cache.staging_bytes,
                weight_format=self.weight_format,
                compiled=self.compiled,
                wide_step_rows=self.wide_step_rows,
                wide_copy_bytes=self._wide_copy_bytes,
                speculate=self.speculate,
                spec_num_drafts=self._spec_num_drafts,
                spec_num_draft_tokens=self._spec_num_draft_tokens,
                spec_num_accepted_tokens=self._spec_num_accepted_tokens,
                **self._disk_stats(),
            )

    @property
    def wide_step_rows(self) -> int | None:
        """The fewest rows a step multiplies by bfloat16 copies of quantized weights; None: never."""
        lean = self.runner.lean_forward
        return None if lean is None else lean.wide_rows

    @property
    def _wide_copy_bytes(self) -> int:
        lean = self.runner.lean_forward
        return 0 if lean is None or lean.wide_copies is None else lean.wide_copies.nbytes

    @property
    def compiled(self) -> bool:
        """Whether decode steps run compiled: asked for, applicable, and not fallen back to eager."""
        step = self.runner.compiled_step
        return step is not None and step.enabled

    def _disk_stats(self) -> dict[str, Any]:
        if self.disk_cache is None:
            return {}
        tier = self.disk_cache.tier.stats()
        return {
            "kv_disk_limit_bytes": tier.limit_bytes,
            "kv_disk_blocks": tier.num_blocks,
            "kv_disk_bytes": tier.num_bytes,
            "kv_disk_hit_tokens": self.disk_cache.num_hit_tokens,
            "kv_disk_written_blocks": tier.num_written_blocks,
            "kv_disk_evicted_blocks": tier.num_evicted_blocks,
            "kv_disk_notice": tier.notice,
        }

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], decode_kernels: bool = True) -> torch.Tensor:
        """Float32 logits (T, V) of one prefill over ``token_ids``: row i is the distribution of
        token i + 1 given tokens 0..i, from the forward this engine decodes with: its decode
        kernels however many rows (a quantized format is judged by what decoding multiplies by),
        or, without ``decode_kernels``, the products a prefill of T rows would use.

        For judging a weight format (runtime/engine/scoring.py). The prefill writes its keys and
        values into the pool's first blocks without the block manager, so it needs an idle engine
        and afterwards forgets the prefix cache those writes made stale.
        """
        stats = self.stats()
        if stats.num_running or stats.num_waiting:
            raise RuntimeError("prompt_logits needs an idle engine: it writes KV outside the block manager")
        if self.kv_cache.layout.quantized:
            raise ValueError("prompt_logits needs KV stored in the model dtype (kv_dtype='auto')")
        num_tokens = len(token_ids)
        if num_tokens > self.pool_capacity_tokens:
            raise ValueError(
                f"{num_tokens} tokens do not fit the KV pool ({self.pool_capacity_tokens} tokens)"
            )
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=positions,  # the pool's first slots, in order
            prefills=[PrefillSpan(0, num_tokens, None, None)],
            decode=None,
        )
        ids = torch.tensor(token_ids, device=self.device)
        with self._step_lock:
            logits = self.runner.forward(ids, positions, meta, positions, decode_kernels)  # (T, V)
        self.reset_prefix_cache()
        return logits.float()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (only unreferenced blocks; running requests keep theirs)."""
        with self._step_lock, self._state_lock:
            self.block_manager.reset_prefix_cache()
            for drafter in self._drafters.values():
                drafter.reset_prefix_cache()


__all__ = ["Completion", "CompletionDelta", "Engine", "SequenceStatus"]
