"""One prompt in, one streamed reply out: what ``liubai run`` does.

This module owns turning a user's prompt into chat-template token ids, streaming the
engine's deltas to stdout, and the closing timing line (or, with ``--json``, one result
object). The headless runner (sessions, ``--jsonl`` events, scripts) will grow from here;
``agent/cli.py`` only wires arguments to :class:`RunOptions`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from runtime.model_registry import DEFAULT_MODEL

# The engine's KV storage dtypes (runtime.kv_quant.KV_DTYPES), spelled out so that building the
# CLI does not import torch; a test keeps the two equal.
KV_DTYPES = ("auto", "int8", "fp8", "int4")

if TYPE_CHECKING:
    from runtime.metrics import RequestMetrics


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Everything one ``liubai run`` needs; validated here so every front door agrees."""

    prompt: str
    model: str = DEFAULT_MODEL
    system: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    kv_pool: str | None = None  # a size such as "256MiB"; None lets the engine choose
    dtype: str = "auto"
    kv_dtype: str = "auto"  # KV storage for keys and values; k_dtype / v_dtype override it
    k_dtype: str | None = None
    v_dtype: str | None = None
    json: bool = False

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ValueError("the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        for flag, value in (
            ("--kv-dtype", self.kv_dtype),
            ("--k-dtype", self.k_dtype),
            ("--v-dtype", self.v_dtype),
        ):
            if value is not None and value not in KV_DTYPES:
                raise ValueError(f"{flag} must be one of {', '.join(KV_DTYPES)}, got {value!r}")
        if self.kv_pool is not None:
            from runtime.sizes import parse_size

            parse_size(self.kv_pool)  # raises ValueError with a readable message


@dataclass(slots=True)
class RunResult:
    """What a finished run produced; ``--json`` prints it, tests inspect it."""

    answer: str
    model: str
    finish_reason: str | None
    metrics: RequestMetrics | None

    def to_dict(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "answer": self.answer,
            "model": self.model,
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": m.num_prompt_tokens if m else 0,
                "cached_tokens": m.num_cached_tokens if m else 0,
                "completion_tokens": m.num_generated_tokens if m else 0,
            },
            "timings": m.to_dict() if m else {},
            "is_error": False,
        }


def build_prompt_ids(tokenizer: Any, prompt: str, system: str | None = None) -> list[int]:
    """The prompt as the model expects it: its chat template with the assistant turn opened.

    Tokenized here, without extra special tokens, because the template already placed them;
    a model without a chat template gets the plain text.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = f"{system}\n\n{prompt}" if system else prompt
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def format_timing(m: RequestMetrics) -> str:
    """``prompt 35 tok (cached 0) · prefill 120 ms · ttft 130 ms · 64 tok in 2.1 s (30.5 tok/s)``."""
    return (
        f"prompt {m.num_prompt_tokens} tok (cached {m.num_cached_tokens}) · "
        f"prefill {m.prefill_ms:.0f} ms · ttft {m.ttft_ms:.0f} ms · "
        f"{m.num_generated_tokens} tok in {m.decode_ms / 1000:.1f} s ({m.decode_tok_s:.1f} tok/s)"
    )


def run_oneshot(options: RunOptions, *, out: TextIO | None = None, err: TextIO | None = None) -> RunResult:
    """Generate one reply, streaming it to ``out`` (stdout) unless ``options.json`` is set."""
    out = out or sys.stdout
    err = err or sys.stderr
    from runtime.model_loader import resolve_model

    # Resolve first: a bad --model fails before the engine allocates anything, and a missing
    # registry model is pulled with its own progress display.
    path = resolve_model(options.model)

    from runtime import Engine, SamplingParams

    engine = Engine(
        model=str(path),
        kv_pool=options.kv_pool,
        dtype=options.dtype,
        device="auto",
        kv_dtype=options.kv_dtype,
        k_dtype=options.k_dtype,
        v_dtype=options.v_dtype,
    )
    prompt_ids = build_prompt_ids(engine.tokenizer, options.prompt, options.system)
    params = SamplingParams(
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_k=options.top_k,
        top_p=options.top_p,
        seed=options.seed,
    )
    parts: list[str] = []
    result = RunResult(answer="", model=options.model, finish_reason=None, metrics=None)
    for delta in engine.stream(prompt_ids, params):
        if delta.text:
            parts.append(delta.text)
            if not options.json:
                out.write(delta.text)
                out.flush()
        if delta.finished:
            result.finish_reason = delta.finish_reason
            result.metrics = delta.metrics
    result.answer = "".join(parts)

    if options.json:
        out.write(json.dumps(result.to_dict(), ensure_ascii=False) + "\n")
        out.flush()
        return result
    if not result.answer.endswith("\n"):
        out.write("\n")  # so the shell prompt and the timing line start on their own line
        out.flush()
    if result.metrics is not None:
        print(format_timing(result.metrics), file=err, flush=True)
    return result
