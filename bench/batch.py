"""Throughput of concurrent requests: one continuous batch against the same work one at a time.

``--requests`` distinct ~200-token chat prompts, exactly ``--new-tokens`` greedy tokens each
(EOS ignored), through one liubai engine: all at once with ``engine.generate(list)``, then
another set of as many distinct prompts one after another on the same engine (distinct so
that the prefix cache cannot serve the sequential run from the concurrent one). The same
concurrent work then goes through transformers twice: ``generate()`` on the prompts
left-padded into one batch (pad = EOS), and transformers' own continuous batching,
``model.generate_batch``. Every figure is generated tokens / wall seconds of the whole call;
``ttft_ms_p50`` is the median of the engine's time to first token over the concurrent
requests.
"""

import argparse
import statistics
from typing import Any

import torch

from bench import common


def parse_args() -> argparse.Namespace:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.new_tokens, args.prompt_tokens = 4, 16, 64
    return args


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, max_len), padding on the left as decoder-only models need."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
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


def tok_s(label: str, run: Any, expected: int) -> float:
    """Run ``run() -> generated token count``; tokens / wall second, checking the count."""
    common.log(f"{label}: running")
    tokens, seconds = common.timed(run)
    if tokens != expected:
        raise RuntimeError(f"{label} generated {tokens} tokens, expected {expected}")
    common.log(f"{label}: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tok/s")
    return tokens / seconds


def main() -> None:
    args = parse_args()
    n, k = args.new_tokens, args.requests
    model_dir = common.resolve_model_dir(args.model)
    engine = common.make_engine(model_dir, args.dtype)
    hf_model = common.load_hf(model_dir, args.dtype)
    prompts = [common.chat_prompt(engine.tokenizer, i, args.prompt_tokens) for i in range(2 * k + 1)]
    concurrent, sequential, warm = prompts[:k], prompts[k:2 * k], prompts[-1:]
    common.log(f"{k} requests of ~{len(concurrent[0])} prompt tokens, {n} new tokens each ({args.dtype})")

    common.log("warm-up")
    engine.generate(warm, common.sampling(4))
    common.hf_generate(hf_model, warm[0], 4)
    hf_continuous_tokens(hf_model, warm, 4)

    completions: list[Any] = []

    def liubai_concurrent() -> int:
        completions.extend(engine.generate(concurrent, common.sampling(n)))
        return sum(len(c.token_ids) for c in completions)

    def liubai_sequential() -> int:
        return sum(len(engine.generate([p], common.sampling(n))[0].token_ids) for p in sequential)

    aggregate = tok_s("liubai concurrent", liubai_concurrent, k * n)
    serial = tok_s("liubai sequential", liubai_sequential, k * n)
    padded = tok_s("transformers padded", lambda: hf_padded_tokens(hf_model, concurrent, n), k * n)
    continuous = tok_s("transformers generate_batch",
                       lambda: hf_continuous_tokens(hf_model, concurrent, n), k * n)
    stats = engine.stats()
    result: dict[str, Any] = {
        "aggregate_tok_s": round(aggregate, 2),
        "sequential_tok_s": round(serial, 2),
        "speedup": common.ratio(aggregate, serial),
        "hf_padded_tok_s": round(padded, 2),
        "hf_batch_tok_s": round(continuous, 2),
        "ttft_ms_p50": round(statistics.median(c.metrics.ttft_ms for c in completions), 1),
        "aggregate_vs_hf_padded": common.ratio(aggregate, padded),
        "aggregate_vs_hf_batch": common.ratio(aggregate, continuous),
        "num_cached_tokens": sum(c.metrics.num_cached_tokens for c in completions),
        "max_batch_size": stats.max_batch_size, "num_preemptions": stats.num_preemptions,
        "requests": k, "new_tokens": n, "prompt_tokens": len(concurrent[0]),
        **common.environment(args, model_dir),
    }
    common.emit("batch", result)


if __name__ == "__main__":
    main()
