"""A session resumed by a new process, with the prefix cache's disk tier against without it.

Resume: a conversation of ``--history-tokens`` tokens (a made-up document and questions, built
offline from a seed) is answered by one process (``--reply-tokens`` greedy tokens) with the disk
tier on, which leaves its blocks on disk. Then the next turn (the history, that reply and a new
question) is run by two fresh processes: one with the tier on (``disk``), one with it off
(``cold``, what every new process paid before). Both stream the turn and report the engine's
TTFT of the turn alone (after a short warm-up request of unrelated tokens) and the wall time
from the process's start to its first token (model load and warm-up included). This runs for
float32 and int8 KV, each with a disk tier of its own.

One-shot: ``liubai run --json --tools on`` (the ~480-token tool prompt) once to fill the tier,
then another question in a fresh process with the tier on and one with ``--kv-disk 0``; TTFT is
the run's ``timings.ttft_ms``.

Both sides of a ratio run in the same benchmark run, alternating which goes first over
``--repeats``; each keeps its best. ``resume_ttft_ratio`` is disk / cold TTFT of the turn alone,
the worse of the KV dtypes; ``resume_ttft_ratio_with_load`` the same from process start;
``oneshot_ttft_ratio`` disk / cold for the one-shot run. ``tokens_equal``: every disk run's
greedy tokens (answer, for the one-shot) equal its cold run's. ``disk_hit_tokens`` and
``disk_bytes`` are per KV dtype (tokens the disk served the resumed turn; bytes of the tier after
the first process).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common

KV_DTYPES = ("auto", "int8")
TARGETS = {"resume_ttft_ratio": 0.2, "oneshot_ttft_ratio": 0.5}


def history(tokenizer: Any, num_tokens: int) -> tuple[list[int], list[int]]:
    """The conversation's prompt (about ``num_tokens`` tokens) and the ids of the next question's
    turn, to append after the reply."""
    system = "You are the archive's historian. Answer from the notes, briefly."
    turns = []
    for i in range(6):
        notes = common.filler_text(200 + i, num_tokens // 8)
        turns += [
            {"role": "user", "content": f"Notes, part {i + 1}:\n{notes}\nWhat do they record?"},
            {"role": "assistant", "content": common.filler_text(300 + i, 30)},
        ]
    messages = [{"role": "system", "content": system}, *turns]
    ids = common.chat_ids(tokenizer, [*messages, {"role": "user", "content": "Which tower is named first?"}])
    while len(ids) > num_tokens and len(messages) > 3:
        del messages[1:3]
        ids = common.chat_ids(
            tokenizer, [*messages, {"role": "user", "content": "Which tower is named first?"}]
        )
    end = "<|im_end|>\n<|im_start|>user\nAnd which river?<|im_end|>\n<|im_start|>assistant\n"
    return ids, list(tokenizer.encode(end, add_special_tokens=False))


# --- one process ------------------------------------------------------------------------------


def child(spec: dict[str, Any]) -> None:
    """Run one request in this (fresh) process and print what it measured as one JSON line."""
    started = time.time()
    engine = common.make_engine(
        spec["model_dir"], spec["dtype"], kv_pool="512MiB", kv_dtype=spec["kv_dtype"], kv_disk=spec["kv_disk"]
    )
    # A first forward pays one-off costs (buffers, lazy init) that are not the tier's to measure;
    # a prompt of its own ids shares no block with the timed one.
    engine.generate([7, 11, 13] * 8, common.sampling(1))
    first_token_at = None
    tokens: list[int] = []
    metrics = None
    for delta in engine.stream(spec["prompt"], common.sampling(spec["max_tokens"])):
        if first_token_at is None:
            first_token_at = time.time()
        tokens += delta.token_ids
        metrics = delta.metrics or metrics
    engine.close()
    assert metrics is not None and first_token_at is not None
    stats = engine.stats()
    print(
        json.dumps(
            {
                "started": started,
                "first_token_at": first_token_at,
                "ttft_ms": metrics.ttft_ms,
                "disk_load_ms": metrics.disk_load_ms,
                "cached": metrics.num_cached_tokens,
                "disk_cached": metrics.num_disk_cached_tokens,
                "prompt": metrics.num_prompt_tokens,
                "tokens": tokens,
                "disk_bytes": stats.kv_disk_bytes,
            }
        )
    )


def spawn(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    launched = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "bench.resume", "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"bench.resume child failed:\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["from_start_ms"] = (result["first_token_at"] - launched) * 1000
    return result


def liubai_run(question: str, kv_disk: str, env: dict[str, str], db: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "agent.cli", "run", "--json", "--tools", "on", "--max-tokens", "16"]
    cmd += ["--model", args.model, "--dtype", args.dtype, "--kv-disk", kv_disk, "--db", str(db), question]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"liubai run failed:\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# --- the benchmark ----------------------------------------------------------------------------


def resume(
    kv_dtype: str, prompt: list[int], next_turn: list[int], args: argparse.Namespace, root: Path
) -> dict:
    env = {**os.environ, "LIUBAI_KV_DISK_DIR": str(root / kv_dtype)}
    base = {"model_dir": args.model_dir, "dtype": args.dtype, "kv_dtype": kv_dtype}
    common.log(f"{kv_dtype}: first process, {len(prompt)} prompt tokens")
    first = spawn({**base, "prompt": prompt, "max_tokens": args.reply_tokens, "kv_disk": "4GiB"}, env)
    resumed = prompt + first["tokens"] + next_turn
    sides: dict[str, list[dict[str, Any]]] = {"disk": [], "cold": []}
    for side in common.alternating(["disk", "cold"], args.repeats):
        kv_disk = "4GiB" if side == "disk" else "0"
        run = spawn({**base, "prompt": resumed, "max_tokens": args.reply_tokens, "kv_disk": kv_disk}, env)
        common.log(f"{kv_dtype} {side}: ttft {run['ttft_ms']:.0f} ms, disk hit {run['disk_cached']} tok")
        sides[side].append(run)
    disk = min(sides["disk"], key=lambda r: r["ttft_ms"])
    cold = min(sides["cold"], key=lambda r: r["ttft_ms"])
    return {
        "prompt_tokens": len(resumed),
        "disk_ttft_ms": round(disk["ttft_ms"], 1),
        "cold_ttft_ms": round(cold["ttft_ms"], 1),
        "disk_load_ms": round(disk["disk_load_ms"], 1),
        "disk_from_start_ms": round(min(r["from_start_ms"] for r in sides["disk"]), 1),
        "cold_from_start_ms": round(min(r["from_start_ms"] for r in sides["cold"]), 1),
        "ttft_ratio": common.ratio(disk["ttft_ms"], cold["ttft_ms"]),
        "ttft_ratio_with_load": common.ratio(
            min(r["from_start_ms"] for r in sides["disk"]), min(r["from_start_ms"] for r in sides["cold"])
        ),
        "disk_hit_tokens": disk["disk_cached"],
        "disk_bytes": first["disk_bytes"],
        "tokens_equal": all(r["tokens"] == sides["cold"][0]["tokens"] for r in sides["disk"] + sides["cold"]),
    }


def oneshot(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    env = {**os.environ, "LIUBAI_KV_DISK_DIR": str(root / "oneshot"), "LIUBAI_DATA_DIR": str(root / "data")}
    common.log("one-shot: filling the tier")
    liubai_run("What does the archive keep?", "4GiB", env, root / "fill.db", args)
    sides: dict[str, list[dict[str, Any]]] = {"disk": [], "cold": []}
    for i, side in enumerate(common.alternating(["disk", "cold"], args.repeats)):
        run = liubai_run(
            "Name one river.", "4GiB" if side == "disk" else "0", env, root / f"{side}{i}.db", args
        )
        common.log(f"one-shot {side}: ttft {run['timings']['ttft_ms']:.0f} ms, usage {run['usage']}")
        sides[side].append(run)
    disk = min(sides["disk"], key=lambda r: r["timings"]["ttft_ms"])
    cold = min(sides["cold"], key=lambda r: r["timings"]["ttft_ms"])
    return {
        "prompt_tokens": disk["usage"]["prompt_tokens"],
        "disk_ttft_ms": disk["timings"]["ttft_ms"],
        "cold_ttft_ms": cold["timings"]["ttft_ms"],
        "ttft_ratio": common.ratio(disk["timings"]["ttft_ms"], cold["timings"]["ttft_ms"]),
        "disk_hit_tokens": disk["usage"]["disk_cached_tokens"],
        "answers_equal": len({r["answer"] for r in sides["disk"] + sides["cold"]}) == 1,
    }


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--history-tokens", type=int, default=3000)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = common.parse(parser)
    if args.child is not None:
        child(json.loads(args.child))
        return
    if args.quick:
        args.history_tokens, args.reply_tokens, args.repeats = 400, 4, 1
    args.model_dir = common.resolve_model_dir(args.model)
    tokenizer = common.load_tokenizer(args.model_dir)
    prompt, next_turn = history(tokenizer, args.history_tokens)
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        root = Path(tmp)
        rows = {kv: resume(kv, prompt, next_turn, args, root) for kv in KV_DTYPES}
        one = oneshot(args, root)
    worst = max(KV_DTYPES, key=lambda kv: rows[kv]["ttft_ratio"] or 0.0)
    resume_ratio = rows[worst]["ttft_ratio"]
    result: dict[str, Any] = {
        "resume_ttft_ratio": resume_ratio,
        "resume_ttft_ratio_with_load": max(rows[kv]["ttft_ratio_with_load"] or 0.0 for kv in KV_DTYPES),
        "oneshot_ttft_ratio": one["ttft_ratio"],
        "disk_hit_tokens": {kv: rows[kv]["disk_hit_tokens"] for kv in KV_DTYPES}
        | {"oneshot": one["disk_hit_tokens"]},
        "disk_bytes": {kv: rows[kv]["disk_bytes"] for kv in KV_DTYPES},
        "tokens_equal": all(rows[kv]["tokens_equal"] for kv in KV_DTYPES) and one["answers_equal"],
        "resume": rows,
        "oneshot": one,
        "targets": TARGETS,
        "meets_targets": {
            "resume_ttft_ratio": resume_ratio is not None and resume_ratio <= TARGETS["resume_ttft_ratio"],
            "oneshot_ttft_ratio": one["ttft_ratio"] is not None
            and one["ttft_ratio"] <= TARGETS["oneshot_ttft_ratio"],
        },
        "history_tokens": args.history_tokens,
        "reply_tokens": args.reply_tokens,
        "repeats": args.repeats,
        **common.environment(args, args.model_dir),
    }
    common.emit("resume", result)


if __name__ == "__main__":
    main()
