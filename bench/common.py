"""What the three benchmarks share: model resolution, prompts, timing, bandwidth and output.

Every benchmark runs liubai and its peers in the same process, one after the other, on the
same prompts and at the same dtype, because on a small shared machine only a ratio measured
in one run means anything. Prompts are built offline and deterministically from a seed, so
two runs see the same token counts; each request of a run gets its own opening line so that
the prefix cache cannot serve one request from another unless a benchmark wants it to.
Progress goes to stderr; the result is ONE JSON object, the last line of stdout (and a copy
under ``bench/results/``).
"""

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
T = TypeVar("T")

_WORDS = (
    "archive ledger river council harvest lantern scribe winter granary bridge treaty market "
    "copper orchard signal tower caravan salt meadow envoy festival quarry tide beacon garrison "
    "library canal mill frontier census monsoon cedar vessel charter kiln ferry reed "
    "pavilion compass terrace glacier courier vineyard foundry delta spire almanac threshold"
).split()
_VERBS = "records keeps measures carries divides guards repairs audits seals returns lends weighs".split()


# --- arguments and model ---------------------------------------------------------------------


def base_parser(description: str, engine_defaults: bool = False) -> argparse.ArgumentParser:
    """The options every benchmark takes. ``engine_defaults``: a benchmark of liubai alone, whose
    ``--dtype`` defaults to the engine's own ("auto") and which takes ``--weights`` (default
    "auto"), so that it measures what a user gets; benchmarks with a transformers peer keep
    float32, a dtype both sides can name."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="short name or model directory")
    if engine_defaults:
        from runtime.layers.weights import WEIGHT_FORMATS

        parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
        parser.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS)
    else:
        parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--threads", type=int, help="CPU threads for every peer (default: torch's)")
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line and give torch the thread count every peer then shares."""
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def resolve_model_dir(model: str) -> str:
    """A directory transformers and liubai both load: a short name is pulled once, a path taken as is."""
    from runtime.models.loader import resolve_model  # late: importing bench must stay cheap

    return str(resolve_model(model))


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_hf(model_dir: str, dtype: str) -> Any:
    """The transformers model in eval mode at ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype))
    return model.eval()


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def make_engine(model_dir: str, dtype: str, **overrides: Any) -> Any:
    """A liubai engine with the benchmarks' defaults; ``overrides`` replace any of them."""
    from runtime import Engine

    kwargs: dict[str, Any] = dict(
        kv_pool="1GiB", block_size=16, max_num_batched_tokens=512, max_num_seqs=64, dtype=dtype, device="cpu"
    )
    kwargs.update(overrides)
    return Engine(model=model_dir, **kwargs)


def sampling(max_tokens: int, ignore_eos: bool = True) -> Any:
    from runtime import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


# --- prompts ---------------------------------------------------------------------------------


def filler_text(seed: int, num_words: int) -> str:
    """Deterministic made-up prose: sentences of archive vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    sentences: list[str] = []
    words = 0
    while words < num_words:
        n = rng.randint(6, 14)
        body = [rng.choice(_WORDS) for _ in range(n)]
        body.insert(2, rng.choice(_VERBS))
        sentences.append(" ".join(body).capitalize() + ".")
        words += len(body)
    return " ".join(sentences)


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the model's chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt(tokenizer: Any, index: int, num_tokens: int) -> list[int]:
    """A chat prompt of about ``num_tokens`` tokens whose first block is unique to ``index``."""
    system = f"Request {index:04d}. You answer questions about the archive in plain words."
    question = "Summarise the following notes and list three open questions about them."

    def build(notes: str) -> list[int]:
        return chat_ids(
            tokenizer,
            [{"role": "system", "content": system}, {"role": "user", "content": f"{question}\n\n{notes}"}],
        )

    budget = max(1, num_tokens - len(build("")))
    notes_ids = tokenizer.encode(filler_text(1000 + index, num_tokens), add_special_tokens=False)
    return build(tokenizer.decode(notes_ids[:budget]))


# --- timing ----------------------------------------------------------------------------------


def now() -> float:
    """Wall-clock seconds for intervals."""
    return time.perf_counter()


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)``'s result and its wall-clock seconds."""
    start = now()
    result = fn(*args)
    return result, now() - start


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def decode_rate(num_tokens: int, t_first: float, t_all: float) -> float | None:
    """Tokens per second after the first: ``(N-1) / (t_N - t_1)``, both times of whole calls.

    None when load elsewhere made the N-token call no slower than the 1-token one: no rate
    can be read from such a pair.
    """
    if t_all <= t_first:
        return None
    return (num_tokens - 1) / (t_all - t_first)


def rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def median_spread(values: list[float | None], digits: int = 3) -> tuple[float | None, list[float] | None]:
    """The median of ``values`` and their ``[min, max]``, rounded; None values are left out."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    low, high = min(present), max(present)
    return round(statistics.median(present), digits), [round(low, digits), round(high, digits)]


def alternating(items: list[T], repeat: int) -> list[T]:
    """``items`` in order on even repeats and reversed on odd ones, so no side always runs first."""
    return list(items) if repeat % 2 == 0 else list(reversed(items))


# --- transformers peer -----------------------------------------------------------------------


def hf_generate(model: Any, ids: list[int] | torch.Tensor, new_tokens: int, **kwargs: Any) -> torch.Tensor:
    """Greedy ``generate()`` of exactly ``new_tokens`` tokens (EOS cannot end it early)."""
    input_ids = ids if isinstance(ids, torch.Tensor) else torch.tensor([ids])
    kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id,
            **kwargs,
        )
    return out[:, input_ids.shape[1] :]


def cache_kwarg(model: Any) -> str:
    """The keyword a transformers model takes its KV cache by (``cache``; ``past_key_values`` before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# --- memory roofline -------------------------------------------------------------------------


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters; ``parameters()`` yields a tied embedding once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def memory_bandwidth_gb_s(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Best read bandwidth of a large float32 tensor (a ``sum`` over it), GB/s (10^9 bytes)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()  # page it in
    best = min(timed(x.sum)[1] for _ in range(repeats))
    return num_bytes / best / 1e9


# --- output ----------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def emit(name: str, result: dict[str, Any]) -> None:
    """Print ``result`` as the last line of stdout and keep a copy in ``bench/results/NAME.json``."""
    line = json.dumps(result, sort_keys=False)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(line + "\n")
    print(line, flush=True)


def environment(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """What a reader needs to reproduce the numbers."""
    import transformers

    return {
        "model": args.model,
        "model_dir": model_dir,
        "dtype": args.dtype,
        "quick": args.quick,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
