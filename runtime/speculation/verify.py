"""Which guessed tokens the model's own logits accept, and the token it adds after them.

Given logits for the last verified token and each of the ``k`` guesses ((k + 1, V) rows), the
result is the accepted guesses followed by one token of the model's: the correction at the
first rejected position, or, when all ``k`` held, the token after the last (the bonus).

Greedy: a guess holds when it equals the argmax of the row before it, so the output is exactly
plain greedy decoding's. Sampling: the guesses are a point mass q, so the standard rule (accept
with min(1, p/q), else draw from max(p - q, 0) normalised) accepts guess d with probability p(d)
and otherwise draws from p with d removed: each emitted token is distributed as p, the
distribution plain sampling draws from (Leviathan et al. 2023, Chen et al. 2023).
"""

import torch

from runtime.engine.sampling import SamplingParams, probabilities


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """logits (k + 1, V) float32; the accepted guesses and the model's next token."""
    best: list[int] = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, draft in enumerate(drafts):
        if draft != best[i]:
            break
        out.append(draft)
    out.append(best[len(out)])
    return out


def verify_sampled(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    out: list[int] = []
    for i, draft in enumerate(drafts):
        p = probabilities(logits[i], params)
        accept_draw = torch.rand((), generator=generator, device=logits.device)
        if accept_draw < p[draft]:
            out.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0
        # p(draft) < 1 here (the draw is below 1), so some mass is left to draw from.
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    p = probabilities(logits[len(drafts)], params)
    out.append(int(torch.multinomial(p, 1, generator=generator)))
    return out
