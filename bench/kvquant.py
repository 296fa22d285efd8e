"""Quantized KV cache: bytes, quality and decode speed of each storage mode, and transformers' peer.

Modes: ``auto`` (the model dtype), ``int8``, ``fp8``, ``k8v4`` (int8 keys, int4 values), ``int4``.
For each: exact ``bytes_per_token``; ``bytes_ratio`` against ``auto`` stored in 16 bits (2 bytes
an element, even though the model runs fp32 on CPU); ``tokens_in_64MiB``; quality teacher-forced
over a fixed English text that ships with the benchmark (``runtime/engine/held_text.txt``, cut to
``--text-tokens``), prefilled in chunks of ``--chunk`` tokens, every position attending to the
blocks before its own as stored (quantized) and to its own block exactly, just as it would
while decoding (``runtime/kv/context.py``); ``kld_mean`` (KL(auto || mode) of the
next-token distributions, mean over positions), ``top1_agree``, ``ppl_delta_pct``; decode speed
with a ``--text-tokens`` context, ``decode_tok_s`` (tokens after the first / time after the
first, best of ``--repeats``) and ``decode_ratio`` against ``auto``: every mode runs the same
forward (the engine's default, named in ``forward``), so the ratio is what the KV format costs.

Peers: transformers' ``QuantizedCache`` with each CPU backend that installs from PyPI (quanto
4-bit, HQQ 4- and 8-bit) and its built-in per-tensor fp8, measured the same way through the
same model (quality against transformers' own ``DynamicCache``), plus the ``DynamicCache`` row.
Each peer's ``decode_ratio_vs_dynamic_cache`` is its decode speed over ``DynamicCache``'s, both
through transformers' forward: what the format costs there. The two ratios are reported apart
(``decode_ratios``) and never divided into each other's sides, since liubai's modes and
transformers' caches run different forwards and a cross ratio would credit the forward's speed
to the KV format. A backend that is not installed is a row with its ``error``. Modes and peers
take turns within every repeat. All-position logits come from a forward hook on the model's
final norm with the engine on transformers' forward (bit-identical to its lean one): the engine
itself only computes logits where it samples.

One torch thread by default (``--threads``): on this 2-core shared machine a second OpenMP
thread stalls for milliseconds whenever the other core is busy, which swamps every ratio.
"""

import argparse
import math
from dataclasses import fields
from typing import Any

import torch

from bench import common

POOL_64MIB = 64 * 2**20
MODES: dict[str, dict[str, str]] = {
    "auto": {},
    "int8": {"kv_dtype": "int8"},
    "fp8": {"kv_dtype": "fp8"},
    "k8v4": {"k_dtype": "int8", "v_dtype": "int4"},
    "int4": {"kv_dtype": "int4"},
}
# name -> (QuantizedCache backend, kwargs); axes as transformers documents for each backend.
PEERS: dict[str, tuple[str, dict[str, int]]] = {
    "quanto-int4": ("quanto", {"nbits": 4}),
    "hqq-int4": ("hqq", {"nbits": 4, "axis_key": 1, "axis_value": 1}),
    "hqq-int8": ("hqq", {"nbits": 8, "axis_key": 1, "axis_value": 1}),
    "fp8-per-tensor": ("fp8", {}),
}
PEER_BITS = {"quanto-int4": 4, "hqq-int4": 4, "hqq-int8": 8, "fp8-per-tensor": 8}
TARGETS = {
    "int8": {"bytes_ratio": 0.53, "kld_mean": 1e-3, "top1_agree": 0.99, "decode_ratio": 0.85},
    "int4": {"bytes_ratio": 0.30, "ppl_delta_pct": 3.0},
}


def parse_args() -> argparse.Namespace:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.set_defaults(threads=1)
    parser.add_argument(
        "--text-tokens", type=int, default=1920, help="tokens of the text (a multiple of 128)"
    )
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk for teacher forcing")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-peers", action="store_true", help="skip transformers' QuantizedCache")
    args = common.parse(parser)
    if args.quick:
        args.text_tokens, args.new_tokens, args.repeats = 256, 8, 1
    return args


# --- liubai ----------------------------------------------------------------------------------


def engine_for(model_dir: str, dtype: str, mode: str, **overrides: Any) -> Any:
    return common.make_engine(model_dir, dtype, kv_pool="256MiB", **MODES[mode], **overrides)


def liubai_logprobs(
    model_dir: str, dtype: str, mode: str, ids: list[int], chunk: int
) -> tuple[torch.Tensor, Any]:
    """Teacher-forced next-token log-probs at every position, (T, V) float32, and the engine's KV cache."""
    from runtime.engine.config import EngineConfig

    # The transformers forward runs the final norm over every position, where a hook sees it.
    extra = {"forward": "transformers"} if "forward" in {f.name for f in fields(EngineConfig)} else {}
    engine = engine_for(model_dir, dtype, mode, max_num_batched_tokens=chunk, **extra)
    hidden: list[torch.Tensor] = []
    hook = engine.model.model.norm.register_forward_hook(lambda _m, _i, out: hidden.append(out[0].detach()))
    try:
        engine.generate([ids], common.sampling(1))
    finally:
        hook.remove()
    h = torch.cat(hidden)[: len(ids)]  # (T, hidden): the chunks in order, then the sampled token
    with torch.inference_mode():
        return engine.model.lm_head(h).float().log_softmax(-1), engine.kv_cache


def tokens_in(pool_bytes: int, bytes_per_block: int, block_size: int) -> int:
    return pool_bytes // bytes_per_block * block_size


# --- transformers' QuantizedCache ------------------------------------------------------------


def make_cache(model: Any, peer: str | None) -> Any:
    from transformers import DynamicCache, QuantizedCache

    if peer is None:
        return DynamicCache(config=model.config)
    backend, kwargs = PEERS[peer]
    return QuantizedCache(backend, model.config, **kwargs)


def hf_logprobs(model: Any, peer: str | None, ids: list[int], chunk: int) -> tuple[torch.Tensor, Any]:
    """Teacher-forced log-probs through ``model`` with the peer's cache, fed ``chunk`` tokens a call."""
    cache = make_cache(model, peer)
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            x = torch.tensor([ids[start : start + chunk]])
            logits = model(x, use_cache=True, **{common.cache_kwarg(model): cache}).logits
            out.append(logits[0].float().log_softmax(-1))
    return torch.cat(out), cache


def hf_decode_tok_s(model: Any, peer: str | None, ids: list[int], new_tokens: int) -> float:
    """Greedy decode speed after a prefill of ``ids``: (N-1) tokens / the time after the first."""
    cache = {common.cache_kwarg(model): make_cache(model, peer)}
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), use_cache=True, **cache).logits
        token = logits[:, -1:].argmax(-1)  # the first token
        start = common.now()
        for _ in range(new_tokens - 1):
            token = model(token, use_cache=True, **cache).logits[:, -1:].argmax(-1)
        return (new_tokens - 1) / (common.now() - start)


def quantized_bytes_per_token(cache: Any) -> float | None:
    """Bytes the peer's quantized states hold per quantized token (scales and zeros included)."""

    def nbytes(obj: Any) -> int:
        if isinstance(obj, torch.Tensor):
            if hasattr(obj, "__tensor_flatten__"):  # quanto's tensor subclasses
                names, _ = obj.__tensor_flatten__()
                return sum(nbytes(getattr(obj, name)) for name in names)
            return obj.numel() * obj.element_size()
        if isinstance(obj, (tuple, list)):
            return sum(nbytes(o) for o in obj)
        if isinstance(obj, dict):
            return sum(nbytes(o) for o in obj.values())
        return 0

    total, tokens = 0, 0
    for layer in cache.layers:
        keys, values = getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)
        if keys is None:
            return None
        total += nbytes(keys) + nbytes(values)
        residual = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
        tokens = layer.cumulative_length - residual
    return round(total / tokens, 1) if tokens else None


# --- quality ---------------------------------------------------------------------------------


def quality(ref: torch.Tensor, test: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """KL(ref || test) mean, top-1 agreement and perplexities over the same positions."""
    kl_sum, agree, rows = 0.0, 0, ref.shape[0]
    for s in range(0, rows, 256):  # bounded temporaries: each (256, V)
        r, t = ref[s : s + 256], test[s : s + 256]
        kl_sum += float((r.exp() * (r - t)).sum())
        agree += int((r.argmax(-1) == t.argmax(-1)).sum())
    target = torch.tensor(ids[1:rows])
    nll_ref = float(-ref[:-1].gather(1, target[:, None]).mean())
    nll = float(-test[:-1].gather(1, target[:, None]).mean())
    return {
        "kld_mean": kl_sum / rows,
        "top1_agree": round(agree / rows, 4),
        "ppl": round(math.exp(nll), 3),
        "ppl_delta_pct": round(100 * (math.exp(nll - nll_ref) - 1), 3),
    }


# --- run -------------------------------------------------------------------------------------


def evaluate_liubai(args: argparse.Namespace, model_dir: str, ids: list[int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    reference: torch.Tensor | None = None
    for mode in MODES:
        common.log(f"liubai {mode}: teacher-forced quality over {len(ids)} tokens, chunks of {args.chunk}")
        logprobs, kv_cache = liubai_logprobs(model_dir, args.dtype, mode, ids, args.chunk)
        if reference is None:
            reference = logprobs
        layout = kv_cache.layout
        row: dict[str, Any] = {
            "mode": mode,
            "k_dtype": kv_cache.k_dtype,
            "v_dtype": kv_cache.v_dtype,
            "bytes_per_token": layout.bytes_per_token,
            "bytes_ratio": round(layout.bytes_per_token / bytes_16bit(layout), 4),
            "tokens_in_64MiB": tokens_in(POOL_64MIB, layout.bytes_per_block, layout.block_size),
            **quality(reference, logprobs, ids),
        }
        row["kld_mean"] = float(f"{row['kld_mean']:.3g}")
        rows.append(row)
        del kv_cache, logprobs
    return rows


def bytes_16bit(layout: Any) -> int:
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * 2


def evaluate_peers(
    args: argparse.Namespace, model_dir: str, ids: list[int]
) -> tuple[Any, list[dict[str, Any]]]:
    model = common.load_hf(model_dir, args.dtype)
    common.log("transformers DynamicCache: teacher-forced reference")
    reference, _ = hf_logprobs(model, None, ids, args.chunk)
    rows: list[dict[str, Any]] = [{"peer": "transformers-dynamic", "bits": None, "note": "full precision"}]
    for peer in PEERS:
        common.log(f"transformers QuantizedCache {peer}: teacher-forced quality")
        row: dict[str, Any] = {"peer": peer, "bits": PEER_BITS[peer]}
        try:
            logprobs, cache = hf_logprobs(model, peer, ids, args.chunk)
        except Exception as exc:  # a backend that fails on CPU is a result, recorded as such
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            continue
        row["quantized_bytes_per_token"] = quantized_bytes_per_token(cache)
        row.update(quality(reference, logprobs, ids))
        row["kld_mean"] = float(f"{row['kld_mean']:.3g}")
        rows.append(row)
    return model, rows


def time_decode(
    args: argparse.Namespace, model_dir: str, ids: list[int], hf_model: Any, peers: list[dict[str, Any]]
) -> tuple[dict[str, float], str]:
    """Best decode tok/s per mode and peer, and the forward every mode ran; all take turns each repeat."""
    engines = {mode: engine_for(model_dir, args.dtype, mode) for mode in MODES}
    forwards = {engine.config.forward for engine in engines.values()}
    if len(forwards) != 1:
        raise RuntimeError(f"the modes' engines run different forwards: {sorted(forwards)}")
    params = common.sampling(args.new_tokens)
    for engine in engines.values():  # warm-up, and the prompt's blocks go into the prefix cache
        engine.generate([ids], common.sampling(2))
    runnable = [p["peer"] for p in peers if "error" not in p]
    if hf_model is not None:
        for peer in runnable:  # warm-up of each cache's one-token decode path
            hf_decode_tok_s(hf_model, None if peer == "transformers-dynamic" else peer, ids[:64], 3)
    best: dict[str, float] = {}
    for r in range(args.repeats):
        for mode, engine in engines.items():
            rate = engine.generate([ids], params)[0].metrics.decode_tok_s
            best[mode] = max(best.get(mode, 0.0), rate)
        if hf_model is not None:
            for peer in runnable:
                name = None if peer == "transformers-dynamic" else peer
                rate = hf_decode_tok_s(hf_model, name, ids, args.new_tokens)
                best[peer] = max(best.get(peer, 0.0), rate)
        common.log(
            f"decode repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items())
        )
    return best, forwards.pop()


def main() -> None:
    from runtime.engine.scoring import held_token_ids

    args = parse_args()
    model_dir = common.resolve_model_dir(args.model)
    tokenizer = common.load_tokenizer(model_dir)
    ids = held_token_ids(tokenizer, args.text_tokens)
    modes = evaluate_liubai(args, model_dir, ids)
    hf_model, peers = (None, []) if args.no_peers else evaluate_peers(args, model_dir, ids)
    rates, forward = time_decode(args, model_dir, ids, hf_model, peers)

    auto_rate, dynamic_rate = rates["auto"], rates.get("transformers-dynamic")
    for row in modes:
        row["decode_tok_s"] = round(rates[row["mode"]], 2)
        row["decode_ratio"] = common.ratio(rates[row["mode"]], auto_rate)
    for row in peers:
        if row["peer"] in rates:
            row["decode_tok_s"] = round(rates[row["peer"]], 2)
            row["decode_ratio_vs_dynamic_cache"] = common.ratio(rates[row["peer"]], dynamic_rate)

    result: dict[str, Any] = {
        "benchmark": "kvquant",
        "text_tokens": len(ids),
        "chunk": args.chunk,
        "new_tokens": args.new_tokens,
        "forward": {"liubai_modes": forward, "quantized_cache": "transformers"},
        "decode_ratios": {
            "liubai_mode_vs_auto": {row["mode"]: row["decode_ratio"] for row in modes},
            "quantized_cache_vs_dynamic_cache": {
                row["peer"]: row.get("decode_ratio_vs_dynamic_cache")
                for row in peers
                if row["peer"] != "transformers-dynamic"
            },
        },
        "modes": modes,
        "quantized_cache": peers if not args.no_peers else {"note": "skipped (--no-peers)"},
        "targets": TARGETS,
        "meets_targets": meets_targets(modes),
        **common.environment(args, model_dir),
    }
    common.emit("kvquant", result)


def meets_targets(modes: list[dict[str, Any]]) -> dict[str, bool]:
    by_mode = {row["mode"]: row for row in modes}
    out: dict[str, bool] = {}
    for mode, targets in TARGETS.items():
        row = by_mode[mode]
        for key, bound in targets.items():
            value = row.get(key)
            ok = value is not None and (
                value >= bound if key in ("top1_agree", "decode_ratio") else value <= bound
            )
            out[f"{mode}.{key}"] = ok
    return out


if __name__ == "__main__":
    main()
