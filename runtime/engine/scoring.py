"""How close one forward's distributions are to a reference's, over a held text.

Judging a weight format (KL divergence, top-1 agreement and perplexity against the stored
weights) needs the distribution at every position of a text, not only at the sampled one:
``Engine.prompt_logits`` gives them from the engine's own forward. :data:`HELD_TEXT` is the
English prose every such judgement scores (``--weights auto``'s choice, ``bench.decode``'s
rows, ``bench.kvquant``, the tests), and :func:`quality` the figures.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

HELD_TEXT = Path(__file__).resolve().parent / "held_text.txt"
HELD_TOKENS = 256  # what every weight format's figures are quoted over
MAX_KLD, MIN_TOP1 = 1e-3, 0.98  # the quality a format must keep against the stored (float32) weights


@dataclass(frozen=True, slots=True)
class Quality:
    """One set of logits against reference logits over the same tokens."""

    kld_mean: float  # KL(reference || logits) of the next-token distributions, mean over positions
    top1_agree: float  # share of positions whose argmax agrees
    ppl_delta_pct: float  # perplexity of the text itself, relative to the reference's


def held_token_ids(tokenizer: object, num_tokens: int = HELD_TOKENS) -> list[int]:
    ids = tokenizer.encode(HELD_TEXT.read_text(), add_special_tokens=False)  # type: ignore[attr-defined]
    return list(ids)[:num_tokens]


def quality(reference: torch.Tensor, logits: torch.Tensor, token_ids: list[int]) -> Quality:
    """``logits`` (T, V) against ``reference`` (T, V), both ``Engine.prompt_logits`` over ``token_ids``."""
    ref, got = torch.log_softmax(reference, dim=-1), torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(token_ids[1:], device=ref.device)[:, None]
    ref_nll = -ref[:-1].gather(1, targets).mean()
    nll = -got[:-1].gather(1, targets).mean()
    return Quality(
        kld_mean=float((ref.exp() * (ref - got)).sum(-1).mean()),
        top1_agree=float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        ppl_delta_pct=float(((nll - ref_nll).exp() - 1) * 100),
    )
