"""The engine's options, validated where they are given."""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.engine.sampling import MAX_NUM_DRAFT_TOKENS, SPECULATE_MODES
from runtime.engine.scheduler import SchedulerConfig
from runtime.kv.quant import KV_DTYPES
from runtime.layers.weights import QUANTIZED_FORMATS, check_weight_format
from runtime.sizes import available_memory_bytes, parse_size
from runtime.speculation.drafter import DEFAULT_NUM_DRAFT_TOKENS, DEFAULT_SPECULATE_MAX_BATCH

DEFAULT_CPU_POOL_BYTES = 1024**3  # 1 GiB: ~23k tokens of SmolLM2 KV in fp32
CPU_POOL_SHARE = 0.2  # never more than this share of the memory available at start
CUDA_POOL_SHARE = 0.5  # of the GPU memory free after the weights are loaded
# "auto": prompt lookup for the weight formats bench.spec measured it in without it ever costing
# more than 5% up to speculate_max_batch (Intel Xeon, 1 thread: bfloat16 1.4-3.3x on its
# four workloads and 1.45x still at batch 8; float32 1.29-2.27x, 1.48-2.0x at batches 1-8; AMD
# EPYC, 2 threads, int4 compiled: 1.23-2.23x, 1.15-2.05x at batches 1-8); off for int8 (not
# measured).
ENGINE_SPECULATE_MODES = ("auto", *SPECULATE_MODES)
SPECULATE_AUTO_FORMATS = ("float32", "bfloat16", "int4")
DEFAULT_SPECULATE = "auto"
DEFAULT_KV_DISK = "2GiB"  # the CLI's disk tier: ~90k tokens of SmolLM2 KV in fp32, ~350k in int8


@dataclass(slots=True)
class EngineConfig:
    model: str | Path = "smollm2-135m-instruct"
    kv_pool: str | int | None = None  # bytes, e.g. "256MiB"; None picks a share of free memory
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's own context length
    dtype: str = "auto"
    device: str = "auto"
    enable_prefix_caching: bool = True
    # KV storage: "auto" (the model dtype), "int8", "fp8" (e4m3) or "int4"; k_dtype / v_dtype
    # override kv_dtype for keys / values alone (e.g. int8 keys with int4 values).
    kv_dtype: str = "auto"
    k_dtype: str | None = None  # None: kv_dtype; after __post_init__ always a name
    v_dtype: str | None = None
    # "auto": the lean Llama-family forward where it applies; "transformers": always the model's own.
    forward: str = "auto"
    # "auto": each product in the form timed fastest on this CPU (gemm.py); "torch": F.linear.
    gemm: str = "auto"
    # Weight format of the lean forward: "float32", "bfloat16", "int8" (per output channel) or
    # "int4" (group 32); "auto": on a CPU with dtype "auto" the fastest format measured on this
    # machine within the quality bound (runtime/engine/weight_plan.py), else the dtype's float
    # weights. int8/int4 run bfloat16 activations.
    weights: str = "auto"
    # Pure-decode steps through graphs compiled by inductor, one per batch bucket
    # (runtime/layers/compiled_step.py). Only the lean forward over a full-precision KV pool
    # compiles; anything else, and a machine where compiling fails, runs eager.
    compile: bool = False
    # Speculative decoding's default for requests that do not choose (SamplingParams.speculate):
    # "auto" (see DEFAULT_SPECULATE), "off", "ngram" (prompt lookup) or "draft" (a second model:
    # draft_model, or this model in draft_weights). num_draft_tokens: most guesses per step;
    # speculate_max_batch: no guessing while more sequences run than this (runtime/speculation/).
    speculate: str = DEFAULT_SPECULATE
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    speculate_max_batch: int = DEFAULT_SPECULATE_MAX_BATCH
    draft_model: str | Path | None = None
    draft_weights: str = "int4"
    # The prefix cache's disk tier: most bytes of block files, e.g. "4GiB"; 0 (the default for an
    # engine built in code; the CLI defaults to DEFAULT_KV_DISK) keeps KV in memory only.
    kv_disk: str | int = 0
    kv_disk_dir: str | Path | None = None  # None: runtime.kv.disk_tier.default_root()
    scheduler: SchedulerConfig = field(init=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.forward not in ("auto", "transformers"):
            raise ValueError(f"forward must be 'auto' or 'transformers', got {self.forward!r}")
        if self.gemm not in ("auto", "torch"):
            raise ValueError(f"gemm must be 'auto' or 'torch', got {self.gemm!r}")
        check_weight_format(self.weights, self.dtype)
        if self.weights in QUANTIZED_FORMATS and self.forward == "transformers":
            raise ValueError(f"{self.weights} weights need the lean forward; drop forward='transformers'")
        if self.kv_pool is not None:
            self.kv_pool = parse_size(self.kv_pool)
        try:
            self.kv_disk = parse_size(self.kv_disk)
        except ValueError as exc:
            raise ValueError(f"kv_disk: {exc}") from exc
        for option in ("kv_dtype", "k_dtype", "v_dtype"):
            value = getattr(self, option)
            if value is not None and value not in KV_DTYPES:
                raise ValueError(f"{option} must be one of {', '.join(KV_DTYPES)}, got {value!r}")
        self.k_dtype = self.k_dtype or self.kv_dtype
        self.v_dtype = self.v_dtype or self.kv_dtype
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.speculate not in ENGINE_SPECULATE_MODES:
            modes = ", ".join(ENGINE_SPECULATE_MODES)
            raise ValueError(f"speculate must be one of {modes}, got {self.speculate!r}")
        if not 1 <= self.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            raise ValueError(
                f"num_draft_tokens must be between 1 and {MAX_NUM_DRAFT_TOKENS}, got {self.num_draft_tokens}"
            )
        if self.speculate_max_batch < 0:
            raise ValueError(f"speculate_max_batch must be >= 0, got {self.speculate_max_batch}")
        check_weight_format(self.draft_weights, "auto")
        self.scheduler = SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)

    def kv_pool_bytes(self, device: torch.device) -> int:
        if self.kv_pool is not None:
            return int(self.kv_pool)
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            return int(free * CUDA_POOL_SHARE)
        return min(DEFAULT_CPU_POOL_BYTES, int(_available_memory() * CPU_POOL_SHARE))


def _available_memory() -> int:
    return available_memory_bytes() or 4 * 1024**3
