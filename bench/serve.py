"""What HTTP costs: concurrent streaming clients of ``liubai serve`` against the same work in process.

``--requests`` distinct ~``--prompt-tokens`` chat prompts, exactly ``--new-tokens`` greedy tokens
each (EOS ignored; the server accepts vLLM's ``ignore_eos`` field), two ways: all at once through
``engine.generate`` in this process, and as that many concurrent streaming clients (threads, each
with the official openai client) of ``liubai serve`` running as a subprocess on loopback with the
same engine settings and thread count. The clients send the prompts as token ids to
``/v1/completions``, so both sides compute exactly the same tokens. Each throughput is generated
tokens / wall seconds of the whole batch; ``http_overhead_ratio`` is served over in-process
throughput (target: >= 0.9).

The two run in turn (alternating which goes first) for ``--repeats`` rounds, each round on fresh
prompts so that neither engine's prefix cache serves a round from an earlier one, and each keeps
its best round. ``ttft_*_ms`` are measured at the client, from sending the request to its first
streamed text, over the best HTTP round; ``inprocess_ttft_*`` are the engine's own figures.
"""

import argparse
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench import common

KV_POOL = "1GiB"  # common.make_engine's pool, given to the server too
ROOT = Path(__file__).resolve().parents[1]
_LISTENING = re.compile(r"liubai serve: (http://\S+/v1) \(model (.+)\)")


def parse_args() -> argparse.Namespace:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8, help="concurrent clients")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of both, each on fresh prompts")
    args = common.parse(parser)
    if args.quick:
        args.requests, args.new_tokens, args.prompt_tokens, args.repeats = 4, 16, 64, 1
    return args


@contextmanager
def served(model_dir: str, dtype: str) -> Iterator[tuple[str, str]]:
    """``liubai serve`` in a subprocess on a free loopback port; yields (base URL, model name).

    Ctrl-C (SIGINT) stops it at the end, the way a user would."""
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    liubai = Path(sys.executable).parent / "liubai"  # the console script beside this interpreter
    command = [str(liubai), "serve", "--model", model_dir, "--port", "0"]
    command += ["--dtype", dtype, "--kv-pool", KV_POOL, "--max-num-seqs", "64"]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=ROOT)
        try:
            yield wait_for_listening(proc, Path(log.name))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for_listening(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300) -> tuple[str, str]:
    deadline = common.now() + timeout_s
    while common.now() < deadline:
        if match := _LISTENING.search(log.read_text()):
            return match.group(1), match.group(2)
        if proc.poll() is not None:
            raise RuntimeError(f"liubai serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"liubai serve did not start within {timeout_s:.0f}s")


def one_stream(client: Any, model: str, prompt: list[int], n: int) -> tuple[float, int]:
    """(seconds to the first streamed text, completion tokens) of one streamed request."""
    start = common.now()
    ttft = math.nan
    tokens = 0
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if math.isnan(ttft) and chunk.choices and chunk.choices[0].text:
            ttft = common.now() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return ttft, tokens


def http_round(url: str, model: str, prompts: list[list[int]], n: int) -> tuple[float, list[float]]:
    """All prompts as concurrent streaming clients; (tokens / wall second, TTFTs in ms)."""
    import openai

    clients = [openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) for _ in prompts]
    results: list[tuple[float, int] | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts) + 1)

    def client(i: int) -> None:
        barrier.wait()
        results[i] = one_stream(clients[i], model, prompts[i], n)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    barrier.wait()
    start = common.now()
    for t in threads:
        t.join()
    seconds = common.now() - start
    done = [r for r in results if r is not None]
    tokens = sum(tokens for _, tokens in done)
    if len(done) != len(prompts) or tokens != n * len(prompts):
        raise RuntimeError(f"HTTP clients got {tokens} tokens from {len(done)} replies, expected {n} each")
    common.log(f"liubai serve: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tok/s")
    return tokens / seconds, [ttft * 1000 for ttft, _ in done]


def inprocess_round(engine: Any, prompts: list[list[int]], n: int) -> tuple[float, list[float]]:
    completions, seconds = common.timed(engine.generate, prompts, common.sampling(n))
    tokens = sum(len(c.token_ids) for c in completions)
    if tokens != n * len(prompts):
        raise RuntimeError(f"in-process generate made {tokens} tokens, expected {n} each")
    common.log(f"in-process: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tok/s")
    return tokens / seconds, [c.metrics.ttft_ms for c in completions]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def main() -> None:
    args = parse_args()
    n, k = args.new_tokens, args.requests
    model_dir = common.resolve_model_dir(args.model)
    engine = common.make_engine(model_dir, args.dtype, kv_pool=KV_POOL, device="auto")
    prompts = [
        common.chat_prompt(engine.tokenizer, i, args.prompt_tokens) for i in range(k * args.repeats + 1)
    ]
    common.log(f"{k} clients, ~{len(prompts[0])} prompt tokens, {n} new tokens each ({args.dtype})")
    with served(model_dir, args.dtype) as (url, model):
        common.log(f"server at {url} (model {model}); warm-up")
        warm = prompts[-1:]
        engine.generate(warm, common.sampling(4))
        http_round(url, model, warm, 4)

        http_rounds, local_rounds = [], []
        for r in range(args.repeats):
            common.log(f"round {r + 1}/{args.repeats}")
            batch = prompts[k * r : k * (r + 1)]
            if r % 2:
                http_rounds.append(http_round(url, model, batch, n))
                local_rounds.append(inprocess_round(engine, batch, n))
            else:
                local_rounds.append(inprocess_round(engine, batch, n))
                http_rounds.append(http_round(url, model, batch, n))

    served_tok_s, ttfts = max(http_rounds, key=lambda round_: round_[0])
    local_tok_s, local_ttfts = max(local_rounds, key=lambda round_: round_[0])
    result: dict[str, Any] = {
        "aggregate_tok_s": round(served_tok_s, 2),
        "inprocess_tok_s": round(local_tok_s, 2),
        "http_overhead_ratio": common.ratio(served_tok_s, local_tok_s),
        "ttft_p50_ms": round(percentile(ttfts, 0.5), 1),
        "ttft_p95_ms": round(percentile(ttfts, 0.95), 1),
        "inprocess_ttft_p50_ms": round(percentile(local_ttfts, 0.5), 1),
        "inprocess_ttft_p95_ms": round(percentile(local_ttfts, 0.95), 1),
        "requests": k,
        "new_tokens": n,
        "prompt_tokens": len(prompts[0]),
        "repeats": args.repeats,
        **common.environment(args, model_dir),
    }
    common.emit("serve", result)


if __name__ == "__main__":
    main()
