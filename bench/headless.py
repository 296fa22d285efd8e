"""Headless sessions run concurrently (``liubai run -j 4``) against the same sessions one by one.

Four scripted sessions of ``--turns`` user turns each, all opening with the same ~300-token
system prompt, go through ``agent.headless.runner.run_headless`` on one engine: first one after
another (``-j 1``), then all four at once (``-j 4``) on fresh scripts with the same shapes, so
that the prefix cache serves neither run from the other beyond the shared system prompt. Every
reply is exactly ``--new-tokens`` long (EOS ignored by a sampling override) so both runs do the
same work.

Keys: ``wall_s_parallel``, ``wall_s_sequential``, ``speedup``; ``prefix_hit_rate`` (cached /
prompt tokens over every request of the parallel run: the shared system prompt and each
session's own history must hit); ``overhead_ms_per_turn`` (agent + store time outside the
engine's requests, per turn) and ``overhead_share`` (of the mean turn's wall time).
"""

import argparse
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common

SYSTEM = (
    "You are the archivist of a river city. You answer in two short sentences, plainly, and you "
    "keep track of every ledger, bridge and granary the user mentions. "
)


def parse_args() -> argparse.Namespace:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--user-tokens", type=int, default=60, help="about this many words per user turn")
    args = common.parse(parser)
    if args.quick:
        args.turns, args.new_tokens, args.user_tokens = 3, 8, 20
    return args


def write_scripts(directory: Path, run: str, sessions: int, turns: int, words: int) -> list[str]:
    paths = []
    seed = sum(map(ord, run)) * 10_000  # deterministic across processes, unlike hash()
    for s in range(sessions):
        path = directory / f"{run}-{s}.jsonl"
        lines = [
            json.dumps(
                {"user": f"Session {run}-{s}, note {t}: " + common.filler_text(seed + s * 100 + t, words)}
            )
            for t in range(turns)
        ]
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def run_once(backend: Any, config: Any, scripts: list[str], jobs: int) -> tuple[float, list[dict[str, Any]]]:
    from agent.headless.runner import HeadlessRun, run_headless

    out = io.StringIO()
    start = time.perf_counter()
    code = run_headless(
        config, HeadlessRun(scripts=scripts, output="json", jobs=jobs), out, io.StringIO(), backend
    )
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"bench.headless: the run failed (exit {code}): {out.getvalue()[-500:]}")
    return wall, [json.loads(line) for line in out.getvalue().splitlines()]


def main() -> None:
    args = parse_args()
    model_dir = common.resolve_model_dir(args.model)
    from agent.config import AgentConfig
    from runtime.backends.backend import LocalBackend

    engine = common.make_engine(model_dir, args.dtype, kv_pool="512MiB")
    # Same work in both runs: every reply is exactly --new-tokens long.
    original_stream = engine.stream

    def stream_ignoring_eos(prompt: Any, params: Any = None, request_id: str | None = None) -> Any:
        params.ignore_eos = True
        return original_stream(prompt, params, request_id)

    engine.stream = stream_ignoring_eos  # type: ignore[method-assign]
    backend = LocalBackend(engine, model_name=args.model)
    system = SYSTEM + common.filler_text(7, 200)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        config = AgentConfig(
            model=args.model,
            db=str(directory / "bench.db"),
            system=system,
            max_tokens=args.new_tokens,
            tools=False,
            kv_budget="8192tok",
        )
        warm = write_scripts(directory, "warm", 1, 1, args.user_tokens)
        run_once(backend, config, warm, 1)  # loads the lazy paths; caches the system prompt

        common.log(f"sequential: {args.sessions} sessions × {args.turns} turns")
        sequential = write_scripts(directory, "seq", args.sessions, args.turns, args.user_tokens)
        wall_seq, _ = run_once(backend, config, sequential, 1)
        common.log(f"  {wall_seq:.1f} s")
        common.log(f"parallel: -j {args.sessions}")
        parallel = write_scripts(directory, "par", args.sessions, args.turns, args.user_tokens)
        wall_par, results = run_once(backend, config, parallel, args.sessions)
        common.log(f"  {wall_par:.1f} s")

    turns = [t for r in results for t in r["turns"]]
    prompt_tokens = sum(t["usage"]["prompt_tokens"] for t in turns)
    cached_tokens = sum(t["usage"]["cached_tokens"] for t in turns)
    first_turn_cached = [r["turns"][0]["usage"]["cached_tokens"] for r in results]
    overhead_ms = sum(r["overhead_ms"] for r in results) / len(turns)
    # Sessions run side by side, so a turn's wall time is the run's wall time over one session's turns.
    mean_turn_ms = wall_par * 1000 / args.turns
    result = {
        "bench": "headless",
        "sessions": args.sessions,
        "turns_per_session": args.turns,
        "new_tokens": args.new_tokens,
        "wall_s_parallel": common.rounded(wall_par, 3),
        "wall_s_sequential": common.rounded(wall_seq, 3),
        "speedup": common.rounded(common.ratio(wall_seq, wall_par), 3),
        "prefix_hit_rate": common.rounded(common.ratio(cached_tokens, prompt_tokens), 3),
        "first_turn_cached_tokens": first_turn_cached,
        "max_batch_size": engine.stats().max_batch_size,
        "overhead_ms_per_turn": common.rounded(overhead_ms, 3),
        "mean_turn_ms": common.rounded(mean_turn_ms, 1),
        "overhead_share": common.rounded(common.ratio(overhead_ms, mean_turn_ms), 4),
        "targets": {"speedup": 2.5, "overhead_share": 0.05},
        **common.environment(args, model_dir),
    }
    common.emit("headless", result)


if __name__ == "__main__":
    main()
