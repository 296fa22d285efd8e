"""Headless runs: ``liubai run`` for scripts and pipelines.

One prompt, or one or more script files, each run as a session of the agent loop. The reply
streams to stdout and notices (timings, compactions, tool calls) go to stderr; ``--json``
prints one result object per session instead, ``--jsonl`` the event stream ending with that
object. Several scripts with ``-j N`` run on N threads through one backend, so a local engine
batches their requests together.

Sessions run on worker threads and the main thread only waits, so Ctrl-C arrives where it
can be handled calmly: every session is cancelled, each stores its partial reply marked
interrupted, and the run exits 130.
"""

import json
import statistics
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

from agent.config import AgentConfig
from agent.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, error_line
from agent.events import Compacted, ErrorOccurred, Event, TokenDelta, ToolCalled, ToolFinished, TurnFinished
from agent.headless.script import Script, ScriptStep, load_script
from agent.session import AgentSession, TurnInterrupted, TurnResult, cost_of, timings_of, usage_of
from memory.errors import MemoryLayerError
from memory.store import Store
from runtime.backends.backend import Backend
from runtime.errors import EngineError

OUTPUTS = ("text", "json", "jsonl")


@dataclass(slots=True)
class HeadlessRun:
    """What to run: a prompt, or scripts; how to report it."""

    prompt: str | None = None
    scripts: list[str] = field(default_factory=list)
    session_id: str | None = None
    output: str = "text"
    jobs: int = 1

    def __post_init__(self) -> None:
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {', '.join(OUTPUTS)}")
        if (self.prompt is None) == (not self.scripts):
            raise ValueError("give a prompt or --script FILE (not both)")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("the prompt is empty")
        if self.jobs < 1:
            raise ValueError(f"-j must be at least 1, got {self.jobs}")
        if self.session_id is not None and len(self.scripts) > 1:
            raise ValueError("--session resumes one session; give one --script with it")


@dataclass(slots=True)
class SessionOutcome:
    """One session's run, as ``--json`` reports it."""

    label: str
    session_id: str | None = None
    model: str = ""
    turns: list[TurnResult] = field(default_factory=list)
    compactions: list[dict[str, Any]] = field(default_factory=list)
    kv: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    interrupted: bool = False
    overhead_ms: float = 0.0  # agent + store time outside the backend's requests
    tools: dict[str, Any] = field(default_factory=dict)  # what --tools resolved to (ToolsDecision)

    @property
    def is_error(self) -> bool:
        return self.error is not None or self.interrupted

    def to_dict(self) -> dict[str, Any]:
        requests = [m for t in self.turns for m in t.requests]
        ttfts = [t.requests[0].ttft_ms for t in self.turns if t.requests]
        return {
            "type": "result",  # as the last line of --jsonl, too: the same object both ways
            "answer": self.turns[-1].answer if self.turns else "",
            "session_id": self.session_id,
            "is_error": self.is_error,
            "error": self.error if self.error else ("interrupted" if self.interrupted else None),
            "model": self.model,
            "usage": usage_of(requests),
            "timings": timings_of(requests, statistics.median(ttfts) if ttfts else 0.0),
            "kv": self.kv,
            "compactions": self.compactions,
            "tools": self.tools or None,
            "cost": cost_of([c for t in self.turns for c in t.costs]),
            "turns": [
                {
                    "turn": t.turn,
                    "answer": t.answer,
                    "finish_reason": t.finish_reason,
                    "interrupted": t.interrupted,
                    "usage": t.usage(),
                    "timings": t.timings(),
                    "kv": t.kv,
                    "cost": t.cost(),
                    "num_tool_rounds": t.num_tool_rounds,
                }
                for t in self.turns
            ],
            "script": self.label or None,
            "overhead_ms": round(self.overhead_ms, 3),
        }


class _Writer:
    """Serialises output from the session threads: text, events, or result objects."""

    def __init__(self, output: str, out: TextIO, err: TextIO, streaming_text: bool) -> None:
        self.output = output
        self.out = out
        self.err = err
        self.streaming_text = streaming_text  # one session in text mode: tokens go out live
        self.lock = threading.Lock()

    def event(self, label: str, session_id: str, event: Event) -> None:
        with self.lock:
            if self.output == "jsonl":
                record = event.to_dict()
                record.setdefault("session_id", session_id)
                if label:
                    record["script"] = label
                self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
                self.out.flush()
                return
            if self.output != "text":
                return
            if isinstance(event, TokenDelta) and self.streaming_text:
                self.out.write(event.text)
                self.out.flush()
            elif isinstance(event, TurnFinished):
                if self.streaming_text:
                    self.out.write("\n" if not event.answer.endswith("\n") else "")
                    self.out.flush()
                self.err.write(_timing_line(event) + "\n")
            elif isinstance(event, Compacted):
                self.err.write(f"liubai: {event.description}\n")
            elif isinstance(event, ToolCalled):
                self.err.write(
                    f"liubai: tool {event.name} {json.dumps(event.arguments, ensure_ascii=False)}\n"
                )
            elif isinstance(event, ToolFinished) and not event.ok:
                self.err.write(
                    f"liubai: tool {event.name}: {event.content.splitlines()[0] if event.content else ''}\n"
                )
            elif isinstance(event, ErrorOccurred):
                self.err.write(error_line(event.message) + "\n")
            self.err.flush()

    def result(self, outcome: SessionOutcome, multi: bool) -> None:
        with self.lock:
            if self.output in ("json", "jsonl"):
                record = outcome.to_dict()
                self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
            elif multi or not self.streaming_text:
                self.out.write(f"== {outcome.label} (session {outcome.session_id}) ==\n")
                for turn in outcome.turns:
                    self.out.write(turn.answer.rstrip("\n") + "\n")
            self.out.flush()
            self.err.flush()


def _timing_line(event: TurnFinished) -> str:
    u, t = event.usage, event.timings
    kv = event.kv
    budget = f"/{kv['budget_tokens']:,}" if kv.get("budget_tokens") else ""
    disk = f", {u['disk_cached_tokens']} from disk" if u.get("disk_cached_tokens") else ""
    accepted = f", accepted {t['mean_accepted_length']:.1f}" if t.get("num_drafts") else ""
    return (
        f"turn {event.turn} · prompt {u['prompt_tokens']} tok (cached {u['cached_tokens']}{disk}) · "
        f"ttft {t['ttft_ms']:.0f} ms · "
        f"{u['generated_tokens']} tok ({t['decode_tok_s']:.1f} tok/s{accepted}) · "
        f"kv {kv.get('tokens', 0):,}{budget} tok"
    )


def run_headless(
    config: AgentConfig,
    run: HeadlessRun,
    out: TextIO | None = None,
    err: TextIO | None = None,
    backend: Backend | None = None,
) -> int:
    """Run the prompt or scripts; return the exit code (0, 1 if any session failed, 130)."""
    out = out or sys.stdout
    err = err or sys.stderr
    # Everything that can be checked without the model is checked first.
    scripts: list[Script | None] = [load_script(p) for p in run.scripts] if run.scripts else [None]
    store = Store(config.db)
    if run.session_id is not None:
        store.get_session(run.session_id)  # an unknown id fails here, before the model loads
    if backend is None:
        from agent.backends import open_backend

        backend = open_backend(config)
    multi = len(scripts) > 1
    writer = _Writer(run.output, out, err, streaming_text=not multi)
    cancel = threading.Event()
    outcomes: list[SessionOutcome] = [
        SessionOutcome(label=str(s.path) if s is not None else "", model=backend.model_name) for s in scripts
    ]

    def work(index: int) -> None:
        script = scripts[index]
        outcome = outcomes[index]
        own_store = store if index == 0 else Store(config.db)  # one connection per thread
        steps = script.steps if script is not None else [ScriptStep("user", run.prompt, "prompt")]
        session_config = config
        if script is not None and script.system is not None and config.system is None:
            from dataclasses import replace

            session_config = replace(config, system=script.system)
        _run_session(backend, own_store, session_config, run.session_id, steps, outcome, writer, cancel)

    with ThreadPoolExecutor(max_workers=min(run.jobs, len(scripts))) as pool:
        futures: list[Future[None]] = [pool.submit(work, i) for i in range(len(scripts))]
        try:
            while not all(f.done() for f in futures):
                time.sleep(0.05)
        except KeyboardInterrupt:
            cancel.set()
            for f in futures:
                f.cancel()
            while not all(f.done() for f in futures):
                try:
                    time.sleep(0.05)
                except KeyboardInterrupt:
                    break
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]  # a bug, not a user error: let it show
    for outcome in outcomes:
        writer.result(outcome, multi)
    if cancel.is_set() or any(o.interrupted for o in outcomes):
        return EXIT_INTERRUPTED
    return EXIT_FAILURE if any(o.is_error for o in outcomes) else EXIT_OK


def _run_session(
    backend: Backend,
    store: Store,
    config: AgentConfig,
    session_id: str | None,
    steps: list[ScriptStep],
    outcome: SessionOutcome,
    writer: _Writer,
    cancel: threading.Event,
) -> None:
    session: AgentSession | None = None

    def emit(event: Event) -> None:
        if isinstance(event, Compacted):
            outcome.compactions.append(event.compaction)
        writer.event(outcome.label, outcome.session_id or "", event)

    try:
        session = AgentSession.open(backend, store, config, session_id)
        outcome.session_id = session.session_id
        outcome.tools = session.tools_decision.to_dict()
        for step in steps:
            if cancel.is_set():
                outcome.interrupted = True
                return
            started = time.perf_counter()
            if step.kind == "user":
                result = session.run_turn(step.value, emit, cancel)
                outcome.turns.append(result)
                outcome.kv = result.kv
                busy = sum(m.prefill_ms + m.decode_ms + m.queue_ms for m in result.requests)
                outcome.overhead_ms += max(0.0, (time.perf_counter() - started) * 1000 - busy)
            elif step.kind == "pin":
                session.pin(step.value)
            elif step.kind == "unpin":
                session.unpin(step.value)
            elif step.kind == "budget":
                session.set_budget(step.value)
            elif step.kind == "compact":
                session.compact(step.value, emit)
            elif step.kind == "clear":
                session.clear(emit)
    except TurnInterrupted as exc:
        outcome.turns.append(exc.result)
        outcome.interrupted = True
    except (EngineError, MemoryLayerError, ValueError) as exc:
        where = f"{step.where}: " if "step" in locals() and step.kind != "user" else ""
        outcome.error = " ".join(f"{where}{exc}".split()) or type(exc).__name__
        emit(ErrorOccurred(outcome.error))
