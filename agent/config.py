"""The options every front door shares (``liubai run``, ``liubai chat``), validated once.

``AgentConfig`` groups what would otherwise be a sprawl of parameters: which model and backend,
the KV budget and dtypes, sampling, tools, prices and the database. ``__post_init__`` raises
``ValueError`` with a message a user can act on; the CLI turns it into exit code 2.
"""

from dataclasses import dataclass, field
from pathlib import Path

from runtime.models.registry import DEFAULT_MODEL

# The engine's KV storage dtypes (runtime.kv.quant.KV_DTYPES), spelled out so that building the
# CLI does not import torch; a test keeps the two equal.
KV_DTYPES = ("auto", "int8", "fp8", "int4")
WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4")  # runtime.layers.weights.WEIGHT_FORMATS
DEFAULT_KV_DISK = "2GiB"  # runtime.engine.config.DEFAULT_KV_DISK, for the same reason
BACKENDS = ("local", "openai")
# Speculative decoding (runtime/speculation/): runtime.engine.config.ENGINE_SPECULATE_MODES and
# MAX_NUM_DRAFT_TOKENS, runtime.engine.config.DEFAULT_SPECULATE, runtime.speculation.drafter's
# DEFAULT_NUM_DRAFT_TOKENS and EngineConfig.draft_weights' default, spelled out like the others.
SPECULATE_MODES = ("auto", "off", "ngram", "draft")
DEFAULT_SPECULATE = "auto"
DEFAULT_NUM_DRAFT_TOKENS = 5
MAX_NUM_DRAFT_TOKENS = 15
DEFAULT_DRAFT_WEIGHTS = "int4"


@dataclass(slots=True)
class AgentConfig:
    model: str = DEFAULT_MODEL
    backend: str = "local"  # or "openai": an OpenAI-compatible server at base_url
    base_url: str | None = None
    api_key_env: str | None = None
    system: str | None = None
    kv_budget: str | None = None  # "24MiB" or "4096tok"; None: the model's context (capped by the pool)
    kv_pool: str | None = None
    kv_disk: str = DEFAULT_KV_DISK  # the prefix cache's disk tier; "0" keeps KV in memory only
    dtype: str = "auto"
    weights: str = "auto"  # the engine's weight format; int8/int4 need dtype auto or bfloat16
    compile: bool = False  # the engine's compiled decode step (runtime/layers/compiled_step.py)
    # Speculative decoding: "off", "ngram" (prompt lookup) or "draft" (draft_model, or this model
    # in draft_weights); None: "draft" when a draft model is named, else "off" (check_speculation).
    speculate: str | None = None
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    draft_model: str | None = None
    draft_weights: str = DEFAULT_DRAFT_WEIGHTS
    kv_dtype: str = "auto"
    k_dtype: str | None = None
    v_dtype: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    db: str | None = None  # None: the user data dir
    # recall, read_file and list_dir: "auto" (only to models that call tools), "on" or "off";
    # True and False are read as "on" and "off"
    tools: str | bool = "auto"
    allow_tools: str = ""  # "shell,write" enables the optional ones
    extra_paths: tuple[str, ...] = ()  # paths besides the working directory the file tools may read
    max_tool_rounds: int = 4
    recall: bool = True
    price_per_hour: float | None = None
    prices: str | None = None  # "in=2.5,cached=1.25,out=10" or a preset name
    price_table: str | None = None
    reserve_tokens: int | None = None  # None: max_tokens
    summary_tokens: int = 192  # most tokens one summarization request may write
    high_watermark: float = 0.85
    low_watermark: float = 0.55
    max_num_seqs: int = 64
    workdir: Path = field(default_factory=Path.cwd)

    def __post_init__(self) -> None:
        from agent.tools.availability import TOOLS_SETTINGS

        if isinstance(self.tools, bool):
            self.tools = "on" if self.tools else "off"
        if self.tools not in TOOLS_SETTINGS:
            raise ValueError(f"--tools must be one of {', '.join(TOOLS_SETTINGS)}, got {self.tools!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "openai" and not self.base_url:
            raise ValueError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.summary_tokens < 16:
            raise ValueError(f"--summary-tokens must be at least 16, got {self.summary_tokens}")
        if self.max_tool_rounds < 0:
            raise ValueError(f"--max-tool-rounds must be >= 0, got {self.max_tool_rounds}")
        for flag, value in (
            ("--kv-dtype", self.kv_dtype),
            ("--k-dtype", self.k_dtype),
            ("--v-dtype", self.v_dtype),
        ):
            if value is not None and value not in KV_DTYPES:
                raise ValueError(f"{flag} must be one of {', '.join(KV_DTYPES)}, got {value!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.weights in ("int8", "int4") and self.dtype not in ("auto", "bfloat16"):
            raise ValueError(
                f"--weights {self.weights} runs with bfloat16 activations; drop --dtype {self.dtype}"
            )
        if self.weights in ("float32", "bfloat16") and self.dtype not in ("auto", self.weights):
            raise ValueError(f"--weights {self.weights} and --dtype {self.dtype} disagree; give one of them")
        self.speculate = check_speculation(
            self.speculate, self.num_draft_tokens, self.draft_model, self.draft_weights
        )
        from runtime.sizes import parse_size

        if self.kv_pool is not None:
            parse_size(self.kv_pool)
        try:
            parse_size(self.kv_disk)
        except ValueError as exc:
            raise ValueError(f"--kv-disk: {exc}") from exc
        if self.kv_budget is not None:
            from memory.budget import BudgetSpec

            BudgetSpec.parse(self.kv_budget)
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise ValueError(f"--price-per-hour must be >= 0, got {self.price_per_hour}")
        from agent.tools.registry import ToolPermissions

        ToolPermissions.parse(self.allow_tools, root=self.workdir)  # validates the names

    @property
    def reply_reserve(self) -> int:
        return self.reserve_tokens if self.reserve_tokens is not None else self.max_tokens


def check_speculation(
    speculate: str | None, num_draft_tokens: int, draft_model: str | None, draft_weights: str
) -> str:
    """The speculation mode these options ask for (``--draft-model`` alone means ``draft``); raise
    ``ValueError`` naming the flag when they are unknown or contradict each other."""
    if speculate is None:
        speculate = "draft" if draft_model is not None else DEFAULT_SPECULATE
    if speculate not in SPECULATE_MODES:
        raise ValueError(f"--speculate must be one of {', '.join(SPECULATE_MODES)}, got {speculate!r}")
    if not 1 <= num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
        raise ValueError(
            f"--num-draft-tokens must be between 1 and {MAX_NUM_DRAFT_TOKENS}, got {num_draft_tokens}"
        )
    if draft_model is not None and speculate != "draft":
        raise ValueError(f"--draft-model drafts only with --speculate draft, not --speculate {speculate}")
    if draft_weights not in WEIGHT_FORMATS:
        raise ValueError(f"--draft-weights must be one of {', '.join(WEIGHT_FORMATS)}, got {draft_weights!r}")
    return speculate
