"""Script files for headless runs: several turns and commands, in JSONL or TOML.

JSONL, one step per line (blank lines and lines starting with ``#`` are skipped)::

    {"system": "You are terse."}          # optional, first step only
    {"user": "My name is Ada."}
    {"pin": 1}
    {"budget": "2048tok"}
    {"compact": "keep the names"}          # or {"compact": true}
    {"clear": true}
    {"user": "What is my name?"}

TOML: an optional top-level ``system`` and an array of ``[[step]]`` tables, each with one key::

    system = "You are terse."
    [[step]]
    user = "My name is Ada."
    [[step]]
    pin = 1

A malformed script is refused before anything runs, with the file and line (or step) at fault.
"""

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEP_KINDS = ("user", "pin", "unpin", "budget", "compact", "clear")


class ScriptError(ValueError):
    """A script file that cannot be read or does not follow the format."""


@dataclass(frozen=True, slots=True)
class ScriptStep:
    kind: str  # one of STEP_KINDS
    value: Any  # the message, turn number, budget, focus (or None), True
    where: str  # "file.jsonl:3" for messages


@dataclass(frozen=True, slots=True)
class Script:
    path: Path
    system: str | None
    steps: list[ScriptStep]

    @property
    def num_turns(self) -> int:
        return sum(1 for s in self.steps if s.kind == "user")


def load_script(path: str | Path) -> Script:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScriptError(f"script not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScriptError(f"cannot read script {path}: {exc}") from None
    if path.suffix.lower() == ".toml":
        return _load_toml(path, text)
    return _load_jsonl(path, text)


def _load_jsonl(path: Path, text: str) -> Script:
    system: str | None = None
    steps: list[ScriptStep] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ScriptError(f"{where}: not valid JSON ({exc.msg})") from None
        if isinstance(item, dict) and set(item) == {"system"}:
            if steps or system is not None:
                raise ScriptError(f"{where}: a system message may only open the script")
            system = _string(item["system"], where, "system")
            continue
        steps.append(_step(item, where))
    return _checked(Script(path, system, steps))


def _load_toml(path: Path, text: str) -> Script:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScriptError(f"{path}: not valid TOML ({exc})") from None
    unknown = set(data) - {"system", "step"}
    if unknown:
        raise ScriptError(
            f"{path}: unknown top-level keys {', '.join(sorted(unknown))} (use system and [[step]])"
        )
    system = _string(data["system"], str(path), "system") if "system" in data else None
    raw_steps = data.get("step", [])
    if not isinstance(raw_steps, list):
        raise ScriptError(f"{path}: step must be an array of tables ([[step]])")
    steps = [_step(item, f"{path} step {i}") for i, item in enumerate(raw_steps, 1)]
    return _checked(Script(path, system, steps))


def _step(item: Any, where: str) -> ScriptStep:
    if isinstance(item, str):
        return ScriptStep("user", _string(item, where, "user"), where)
    if not isinstance(item, dict) or len(item) != 1:
        raise ScriptError(f"{where}: each step is an object with exactly one of {', '.join(STEP_KINDS)}")
    ((kind, value),) = item.items()
    if kind not in STEP_KINDS:
        raise ScriptError(f"{where}: unknown step {kind!r} (expected one of {', '.join(STEP_KINDS)})")
    if kind == "user":
        return ScriptStep(kind, _string(value, where, kind), where)
    if kind in ("pin", "unpin"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScriptError(f"{where}: {kind} takes a turn number (1, 2, ...), got {value!r}")
        return ScriptStep(kind, value, where)
    if kind == "budget":
        from memory.budget import BudgetSpec

        if not isinstance(value, str | int) or isinstance(value, bool):
            raise ScriptError(f'{where}: budget takes a size such as "24MiB" or "4096tok", got {value!r}')
        try:
            BudgetSpec.parse(value)
        except ValueError as exc:
            raise ScriptError(f"{where}: {exc}") from None
        return ScriptStep(kind, str(value) if isinstance(value, str) else f"{value}tok", where)
    if kind == "compact":
        if value is True:
            return ScriptStep(kind, None, where)
        return ScriptStep(kind, _string(value, where, kind), where)
    if value is not True:  # clear
        raise ScriptError(f"{where}: clear takes true, got {value!r}")
    return ScriptStep(kind, True, where)


def _string(value: Any, where: str, kind: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ScriptError(f"{where}: {kind} must be a non-empty string, got {value!r}")
    return value


def _checked(script: Script) -> Script:
    if script.num_turns == 0:
        raise ScriptError(f"{script.path}: the script has no user message")
    return script
