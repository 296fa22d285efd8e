"""Headless sessions run concurrently (``liubai run -j 4``) against the same sessions one by one.

Four scripted sessions of ``--turns`` user turns each, all opening with the same ~300-token
system prompt, go through ``agent.headless.runner.run_headless`` on one engine two ways: one
after another (``-j 1``) and all four at once (``-j 4``), each run on fresh scripts with the
same shapes, so that the prefix cache serves no run from another beyond the shared system
prompt. Every reply is exactly ``--new-tokens`` long (EOS ignored by a sampling override) so
both ways do the same work. Before timing, each way runs once at its own shape (one session at
``-j 1``, all sessions at ``-j 4``, two turns each), so neither pays for a first batch shape.

The two take turns for ``--repeats`` rounds, alternating which goes first (as ``bench.serve``
does). Keys are medians over the rounds, each with its ``[min, max]`` under ``spread``:
``wall_s_parallel``, ``wall_s_sequential``, ``speedup`` (of each round's pair, then the
median); ``prefix_hit_rate`` (cached / prompt tokens over every request of a parallel run: the
shared system prompt and each session's own history must hit); ``overhead_ms_per_turn`` (agent
+ store time outside the engine's requests, per turn) and ``overhead_share`` (of the mean turn's
wall time), both from the parallel runs.

The engine runs at liubai's own defaults (``--dtype auto --weights auto``: the format the weight
plan picks on this machine), since that is what the -j 4 target is about; ``--dtype float32``
measures float32 weights, as this benchmark did by default until 2026-12-07.
"""

import argparse
import io
import json
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from bench import common

SYSTEM = (
    "You are the archivist of a river city. You answer in two short sentences, plainly, and you "
    "keep track of every ledger, bridge and granary the user mentions. "
)


# The keys reported as the median over rounds (with their spread), and their rounding.
SUMMARISED = {
    "wall_s_parallel": 3,
    "wall_s_sequential": 3,
    "speedup": 3,
    "prefix_hit_rate": 3,
    "overhead_ms_per_turn": 3,
    "mean_turn_ms": 1,
    "overhead_share": 4,
}


def parse_args() -> argparse.Namespace:
    parser = common.base_parser(__doc__.splitlines()[0], engine_defaults=True)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--user-tokens", type=int, default=60, help="about this many words per user turn")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of both, each on fresh scripts")
    args = common.parse(parser)
    if args.quick:
        args.turns, args.new_tokens, args.user_tokens, args.repeats = 3, 8, 20, 2
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def write_scripts(directory: Path, run: str, sessions: int, turns: int, words: int) -> list[str]:
    paths = []
    seed = zlib.crc32(run.encode()) % 10**6 * 10_000  # deterministic across processes, unlike hash()
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


def one_round(walls: dict[str, float], results: list[dict[str, Any]], turns: int) -> dict[str, Any]:
    """One round's figures: both wall times, and the parallel run's cache hits and overhead."""
    all_turns = [t for r in results for t in r["turns"]]
    prompt_tokens = sum(t["usage"]["prompt_tokens"] for t in all_turns)
    cached_tokens = sum(t["usage"]["cached_tokens"] for t in all_turns)
    overhead_ms = sum(r["overhead_ms"] for r in results) / len(all_turns)
    # Sessions run side by side, so a turn's wall time is the run's wall time over one session's turns.
    mean_turn_ms = walls["parallel"] * 1000 / turns
    return {
        "wall_s_parallel": round(walls["parallel"], 3),
        "wall_s_sequential": round(walls["sequential"], 3),
        "speedup": common.ratio(walls["sequential"], walls["parallel"]),
        "prefix_hit_rate": common.ratio(cached_tokens, prompt_tokens),
        "first_turn_cached_tokens": [r["turns"][0]["usage"]["cached_tokens"] for r in results],
        "overhead_ms_per_turn": round(overhead_ms, 3),
        "mean_turn_ms": round(mean_turn_ms, 1),
        "overhead_share": common.rounded(common.ratio(overhead_ms, mean_turn_ms), 4),
    }


def main() -> None:
    args = parse_args()
    model_dir = common.resolve_model_dir(args.model)
    from agent.config import AgentConfig
    from runtime.backends.backend import LocalBackend

    engine = common.make_engine(model_dir, args.dtype, kv_pool="512MiB", weights=args.weights)
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
        for jobs in (1, args.sessions):  # each way once at the shape it is timed at
            warm = write_scripts(directory, f"warm-j{jobs}", jobs, 2, args.user_tokens)
            run_once(backend, config, warm, jobs)

        rounds: list[dict[str, Any]] = []
        for r in range(args.repeats):
            order = common.alternating(["sequential", "parallel"], r)
            common.log(f"round {r + 1}/{args.repeats}: {', '.join(order)}")
            walls: dict[str, float] = {}
            outputs: dict[str, list[dict[str, Any]]] = {}
            for way in order:
                jobs = 1 if way == "sequential" else args.sessions
                scripts = write_scripts(directory, f"{way}-{r}", args.sessions, args.turns, args.user_tokens)
                walls[way], outputs[way] = run_once(backend, config, scripts, jobs)
                common.log(f"  {way} (-j {jobs}): {walls[way]:.1f} s")
            rounds.append(one_round(walls, outputs["parallel"], args.turns))

    medians: dict[str, float | None] = {}
    spread: dict[str, list[float] | None] = {}
    for key, digits in SUMMARISED.items():
        medians[key], spread[key] = common.median_spread([r[key] for r in rounds], digits)
    result = {
        "bench": "headless",
        "sessions": args.sessions,
        "turns_per_session": args.turns,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        **medians,
        "spread": spread,
        "rounds": rounds,
        "max_batch_size": engine.stats().max_batch_size,
        "weights": engine.weight_format,  # what "auto" chose, where it was asked for
        "speculate": engine.speculate,  # what "auto" resolved to for this format
        "targets": {"speedup": 2.5, "overhead_share": 0.05},
        **common.environment(args, model_dir),
    }
    common.emit("headless", result)


if __name__ == "__main__":
    main()
