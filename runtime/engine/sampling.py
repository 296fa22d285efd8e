"""Sampling parameters and the sampler that turns logits into next tokens.

Greedy decoding is an ``argmax`` over float32 logits, the same operation transformers'
``generate()`` performs, so that greedy output can be compared with it token for token.
Random sampling draws from a per-request ``torch.Generator``: a seeded request gives the same
tokens whatever else shares its batch.
"""

from dataclasses import dataclass, field

import torch

SPECULATE_MODES = ("off", "ngram", "draft")
# Verifying k guesses reads the weights once for k + 1 rows; past ~16 rows a step stops being
# weight-bound on these CPUs, so longer guesses only add compute.
MAX_NUM_DRAFT_TOKENS = 15


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)
    include_stop_str_in_output: bool = False
    # Speculative decoding for this request: "off", "ngram" or "draft"; None takes the engine's
    # (runtime/speculation/). num_draft_tokens: most tokens guessed per step; None the engine's.
    speculate: str | None = None
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.speculate is not None and self.speculate not in SPECULATE_MODES:
            raise ValueError(f"speculate must be one of {', '.join(SPECULATE_MODES)}, got {self.speculate!r}")
        if self.num_draft_tokens is not None and not 1 <= self.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            raise ValueError(
                f"num_draft_tokens must be between 1 and {MAX_NUM_DRAFT_TOKENS}, got {self.num_draft_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def sample(
    logits: torch.Tensor,  # (B, V) float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Pick one token per row."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, p, generator in zip(logits, params, generators, strict=True):
        if p.greedy:
            tokens.append(int(row.argmax()))
            continue
        tokens.append(int(torch.multinomial(probabilities(row, p), 1, generator=generator)))
    return tokens


def probabilities(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: (V,) logits after temperature, top-k
    and top-p, softmaxed. Speculative verification accepts guesses against the same one."""
    scores = row / p.temperature
    if p.top_k and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop = (cumulative - sorted_scores.softmax(dim=-1)) >= p.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    return scores.softmax(dim=-1)
