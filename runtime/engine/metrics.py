"""Snapshots of what the engine measured: one per request, one for the whole engine.

Both are plain dataclasses so that the agent, the store and the TUI can copy, serialise and
compare them without reaching into engine internals. Times are milliseconds of wall clock
(``time.perf_counter``) unless a name says otherwise.
"""

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestMetrics:
    """What one request cost, from arrival to its last token."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_disk_cached_tokens: int = 0  # of those, the ones the disk tier loaded (the rest were in memory)
    disk_load_ms: float = 0.0  # reading and verifying block files (inside queue_ms / ttft_ms)
    num_prefilled_tokens: int = 0  # prompt tokens actually computed (recomputes after preemption included)
    queue_ms: float = 0.0  # arrival -> first scheduled
    prefill_ms: float = 0.0  # first scheduled -> prompt fully computed
    ttft_ms: float = 0.0  # arrival -> first generated token
    num_generated_tokens: int = 0
    decode_ms: float = 0.0  # first generated token -> last generated token
    inter_token_ms: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    # Speculative decoding (runtime/speculation/): steps that verified guesses, guessed tokens,
    # and those the model accepted (vLLM's num_drafts / num_draft_tokens / num_accepted_tokens).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: the accepted guesses plus the model's
        own next token (vLLM's mean acceptance length); 0 without verification steps."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first one; 0 when fewer than two tokens were generated."""
        if self.num_generated_tokens < 2 or self.decode_ms <= 0:
            return 0.0
        return (self.num_generated_tokens - 1) / (self.decode_ms / 1000.0)

    @property
    def prefill_tok_s(self) -> float:
        if self.num_prefilled_tokens == 0 or self.prefill_ms <= 0:
            return 0.0
        return self.num_prefilled_tokens / (self.prefill_ms / 1000.0)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["decode_tok_s"] = self.decode_tok_s
        data["prefill_tok_s"] = self.prefill_tok_s
        data["acceptance_rate"] = self.acceptance_rate
        data["mean_accepted_length"] = self.mean_accepted_length
        return data


@dataclass(slots=True, frozen=True)
class EngineStats:
    """The engine's KV memory and prefix cache at one moment."""

    block_size: int
    num_blocks_total: int
    num_blocks_used: int  # referenced by at least one live request
    num_blocks_cached: int  # unreferenced but holding a reusable prefix
    num_blocks_free: int  # unreferenced and empty
    kv_tokens_in_use: int  # tokens stored in used blocks
    kv_bytes_in_use: int  # bytes of the used blocks (whole blocks: that is what is reserved)
    kv_pool_bytes: int
    bytes_per_token: int
    k_dtype: str
    v_dtype: str
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_hittable_tokens: int  # the block-size floor: the most that could have hit
    num_preemptions: int
    max_batch_size: int  # most requests in one forward step so far
    num_running: int
    num_waiting: int
    # Full-precision staging of a quantized pool's open (partial) blocks, allocated now; outside
    # kv_pool_bytes and bytes_per_token. 0 when both K and V are stored in the model dtype.
    kv_staging_bytes: int = 0
    # How the model's matrices are stored and multiplied: float32, bfloat16, int8 or int4.
    weight_format: str = "float32"
    # Whether decode steps run through compiled graphs now (runtime/layers/compiled_step.py):
    # False when compiling is off, does not apply, or failed and fell back to eager.
    compiled: bool = False
    # Steps of at least this many rows multiply by bfloat16 copies of the quantized weights
    # (runtime/layers/wide_steps.py), which take wide_copy_bytes; None: the kernels throughout.
    wide_step_rows: int | None = None
    wide_copy_bytes: int = 0
    # Speculative decoding: the engine's default drafter ("off", "ngram" or "draft") and the
    # totals over every request so far (vLLM's spec_decode counters).
    speculate: str = "off"
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # The prefix cache's disk tier (runtime/kv/disk_tier.py): all fingerprints' files under its
    # root, this engine's hits, writes and evictions. kv_disk_limit_bytes 0: no tier.
    kv_disk_limit_bytes: int = 0
    kv_disk_blocks: int = 0
    kv_disk_bytes: int = 0
    kv_disk_hit_tokens: int = 0
    kv_disk_written_blocks: int = 0
    kv_disk_evicted_blocks: int = 0
    kv_disk_notice: str | None = None  # why the tier turned itself off, if it did

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_queried_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queried_tokens

    @property
    def spec_acceptance_rate(self) -> float:
        if not self.spec_num_draft_tokens:
            return 0.0
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def spec_mean_accepted_length(self) -> float:
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def kv_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["prefix_hit_rate"] = self.prefix_hit_rate
        data["kv_usage"] = self.kv_usage
        data["spec_acceptance_rate"] = self.spec_acceptance_rate
        data["spec_mean_accepted_length"] = self.spec_mean_accepted_length
        return data
