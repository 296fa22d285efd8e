"""Throughput of concurrent requests: one continuous batch against the same work one at a time.

``--requests`` distinct ~200-token chat prompts, exactly ``--new-tokens`` greedy tokens each
(EOS ignored), through one liubai engine: all at once with ``engine.generate(list)``, then
another set of as many distinct prompts one after another on the same engine (distinct so
that the prefix cache cannot serve the sequential run from the concurrent one). The same
concurrent work then goes through transformers twice: ``generate()`` on the prompts
left-padded into one batch (pad = EOS), and transformers' own continuous batching,
``model.generate_batch``. Every figure is generated tokens / wall seconds of the whole call.

Before timing, every configuration runs once at the shape it is timed at (both concurrent
liubai and the two transformers batches at ``--requests`` prompts, liubai alone at one)
on prompts of their own. The four then run in turn for ``--repeats`` rounds, each round on
fresh prompts and in the reverse order of the round before (as ``bench.serve`` alternates), so
no configuration always runs first. Every figure is the median over the rounds, with its
``[min, max]`` under ``spread``; each ratio is taken within a round, then its median. ``ttft_ms_p50``
is the median over rounds of the engine's median time to first token over the round's
concurrent requests.
"""

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from bench import common


def parse_args() -> argparse.Namespace:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all four, each on fresh prompts")
    parser.add_argument(
        "--weights",
        default="auto",
        help="liubai's weight format (auto: --dtype's float weights; int8/int4 need --dtype bfloat16); "
        "transformers always runs --dtype",
    )
    parser.add_argument(
        "--compile", action="store_true", help="liubai's compiled decode step (its compiles in the warm-up)"
    )
    args = common.parse(parser)
    if args.quick:
        args.requests, args.new_tokens, args.prompt_tokens, args.repeats = 4, 16, 64, 2
    if args.repeats < 1 or args.requests < 1:
        parser.error("--repeats and --requests must be at least 1")
    return args


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, max_len), padding on the left as decoder-only models need."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def hf_padded_tokens(model: Any, prompts: list[list[int]], n: int) -> int:
    ids, mask = left_padded(prompts, model.generation_config.eos_token_id)
    return common.hf_generate(model, ids, n, attention_mask=mask).numel()


def hf_continuous_tokens(model: Any, prompts: list[list[int]], n: int) -> int:
    """transformers' continuous batching; ``eos_token_id=-1`` makes every request run to ``n``."""
    from transformers import GenerationConfig

    pad_id = model.generation_config.eos_token_id
    config = GenerationConfig(max_new_tokens=n, eos_token_id=-1, pad_token_id=pad_id, do_sample=False)
    with torch.inference_mode():
        outputs = model.generate_batch(inputs=prompts, generation_config=config)
    failed = [o.error for o in outputs.values() if o.error is not None]
    if failed or len(outputs) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(outputs)}/{len(prompts)} results; errors: {failed}")
    return sum(len(o.generated_tokens) for o in outputs.values())


def tok_s(label: str, run: Callable[[], int], expected: int) -> float:
    """Run ``run() -> generated token count``; tokens / wall second, checking the count."""
    tokens, seconds = common.timed(run)
    if tokens != expected:
        raise RuntimeError(f"{label} generated {tokens} tokens, expected {expected}")
    common.log(f"{label}: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tok/s")
    return tokens / seconds


def one_round(
    engine: Any, hf_model: Any, prompts: list[list[int]], n: int, repeat: int
) -> tuple[dict[str, float], list[Any]]:
    """Every configuration once: the first half of ``prompts`` concurrently (liubai and both
    transformers batches on the same prompts), the second half one by one through liubai; in
    the listed order on even rounds, reversed on odd ones."""
    k = len(prompts) // 2
    concurrent, sequential = prompts[:k], prompts[k:]
    completions: list[Any] = []

    def liubai_concurrent() -> int:
        completions.extend(engine.generate(concurrent, common.sampling(n)))
        return sum(len(c.token_ids) for c in completions)

    def liubai_sequential() -> int:
        return sum(len(engine.generate([p], common.sampling(n))[0].token_ids) for p in sequential)

    runs: dict[str, Callable[[], int]] = {
        "liubai concurrent": liubai_concurrent,
        "liubai sequential": liubai_sequential,
        "transformers padded": lambda: hf_padded_tokens(hf_model, concurrent, n),
        "transformers generate_batch": lambda: hf_continuous_tokens(hf_model, concurrent, n),
    }
    order = common.alternating(list(runs), repeat)
    rates = {label: tok_s(label, runs[label], k * n) for label in order}
    return {label: rates[label] for label in runs}, completions


def main() -> None:
    args = parse_args()
    n, k = args.new_tokens, args.requests
    model_dir = common.resolve_model_dir(args.model)
    engine = common.make_engine(model_dir, args.dtype, weights=args.weights, compile=args.compile)
    hf_model = common.load_hf(model_dir, args.dtype)
    # Per round k prompts for the concurrent batch and k for the sequential side; k + 1 to warm up.
    prompts = [
        common.chat_prompt(engine.tokenizer, i, args.prompt_tokens)
        for i in range(2 * k * args.repeats + k + 1)
    ]
    common.log(f"{k} requests of ~{len(prompts[0])} prompt tokens, {n} new tokens each ({args.dtype})")
    common.log(f"liubai: {engine.weight_format} weights, compiled step {'on' if args.compile else 'off'}")
    common.log(f"warm-up: the batches at {k}, liubai alone at 1")
    warm, warm_alone = prompts[-k - 1 : -1], prompts[-1]
    engine.generate(warm, common.sampling(4))
    engine.generate([warm_alone], common.sampling(4))
    hf_padded_tokens(hf_model, warm, 4)
    hf_continuous_tokens(hf_model, warm, 4)

    rounds = []
    for r in range(args.repeats):  # fresh prompts each round: no prefix hit across rounds
        common.log(f"round {r + 1}/{args.repeats}")
        rounds.append(one_round(engine, hf_model, prompts[2 * k * r : 2 * k * (r + 1)], n, r))
    per_round = [
        {
            "aggregate_tok_s": rates["liubai concurrent"],
            "sequential_tok_s": rates["liubai sequential"],
            "hf_padded_tok_s": rates["transformers padded"],
            "hf_batch_tok_s": rates["transformers generate_batch"],
            "speedup": rates["liubai concurrent"] / rates["liubai sequential"],
            "aggregate_vs_hf_padded": rates["liubai concurrent"] / rates["transformers padded"],
            "aggregate_vs_hf_batch": rates["liubai concurrent"] / rates["transformers generate_batch"],
            "ttft_ms_p50": statistics.median(c.metrics.ttft_ms for c in completions),
        }
        for rates, completions in rounds
    ]
    medians: dict[str, float | None] = {}
    spread: dict[str, list[float] | None] = {}
    for key in per_round[0]:
        digits = 3 if "speedup" in key or "_vs_" in key else 1 if key == "ttft_ms_p50" else 2
        medians[key], spread[key] = common.median_spread([r[key] for r in per_round], digits)
    completions = [c for _, round_completions in rounds for c in round_completions]
    stats = engine.stats()
    result: dict[str, Any] = {
        **medians,
        "spread": spread,
        "num_cached_tokens": sum(c.metrics.num_cached_tokens for c in completions),
        "format": engine.weight_format,
        "compiled": bool(engine.compiled),  # False where compiling fell back to eager
        "hf_padded_dtype": args.dtype,
        "max_batch_size": stats.max_batch_size,
        "num_preemptions": stats.num_preemptions,
        "requests": k,
        "new_tokens": n,
        "prompt_tokens": len(prompts[0]),
        "repeats": args.repeats,
        **common.environment(args, model_dir),
    }
    common.emit("batch", result)


if __name__ == "__main__":
    main()
