"""Tool calls in the model's own words: the Hermes ``<tool_call>`` format, parsed and hidden.

ChatML models (SmolLM2, Qwen2.5, Hermes) call a tool by writing a JSON object between
``<tool_call>`` and ``</tool_call>`` tags, and read the result back from a ``tool`` message
wrapped in ``<tool_response>`` tags. This module owns that text format and nothing else:
:func:`parse_tool_calls` turns a finished reply into :class:`ToolCall` values (and one-line
errors for blocks the model got wrong, so the loop can tell it), :class:`ToolCallStreamFilter`
keeps the markup out of what the user sees while the reply streams, and
:func:`tool_result_message` / :func:`tools_system_prompt` write the other half of the
conversation. Running a call is :mod:`agent.tools.registry`' business.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agent.tools.result import ToolResult

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One call the model asked for; ``raw`` is its whole block, tags included."""

    name: str
    arguments: dict[str, Any]
    raw: str


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """Split a finished reply into its prose, its tool calls, and errors for malformed blocks.

    Returns ``(text without the blocks, stripped; calls in order; one-line errors)``. A block
    may hold one call object or a JSON list of them (SmolLM2's own tool format), and
    ``arguments`` may be an object or a JSON string holding one. A ``<tool_call>`` that is
    never closed (the model ran out of tokens) is an error, not silently dropped.
    """
    prose: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    num_blocks = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        prose.append(text[pos:start])
        num_blocks += 1
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end < 0:
            errors.append(f"tool call {num_blocks}: <tool_call> was never closed with </tool_call>")
            pos = len(text)
            break
        pos = end + len(TOOL_CALL_CLOSE)
        raw = text[start:pos]
        try:
            calls.extend(_parse_block(text[body_start:end], raw))
        except ValueError as e:
            errors.append(f"tool call {num_blocks}: {e}")
    prose.append(text[pos:])
    return "".join(prose).strip(), calls, errors


def _parse_block(body: str, raw: str) -> list[ToolCall]:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    items = payload if isinstance(payload, list) else [payload]
    if not items:
        raise ValueError("empty list of calls")
    return [_parse_call(item, raw) for item in items]


def _parse_call(item: object, raw: str) -> ToolCall:
    if not isinstance(item, dict):
        raise ValueError(f'expected an object {{"name": ..., "arguments": {{...}}}}, got {_json_type(item)}')
    name = item.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError('missing "name" (a non-empty string)')
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):
        # Some models encode the arguments object as a JSON string, as OpenAI's API does.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f'"arguments" is a string but not valid JSON ({e.msg})') from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f'"arguments" must be an object, got {_json_type(arguments)}')
    return ToolCall(name=name.strip(), arguments=arguments, raw=raw)


def _json_type(value: object) -> str:
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


class ToolCallStreamFilter:
    """Hides ``<tool_call>`` blocks from a reply as it streams, so the UI never shows markup.

    Text passes through as soon as it cannot be the start of a tag. From ``<tool_call>`` to
    ``</tool_call>`` everything is held back (and dropped: the finished reply goes through
    :func:`parse_tool_calls`); text after the block shows again. A delta ending in a possible
    partial tag such as ``<tool_`` is held until the next delta decides it. The concatenation
    of everything ``feed`` and ``flush`` return is the reply with its blocks removed.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False

    @property
    def in_tool_call(self) -> bool:
        """Whether the stream is inside a tool-call block now (a UI may show a spinner)."""
        return self._in_call

    def feed(self, delta: str) -> str:
        """Take the next streamed delta; return what may be shown to the user now."""
        text = self._pending + delta
        shown: list[str] = []
        while True:
            tag = TOOL_CALL_CLOSE if self._in_call else TOOL_CALL_OPEN
            at = text.find(tag)
            if at < 0:
                keep = _partial_tag_len(text, tag)
                if not self._in_call:
                    shown.append(text[: len(text) - keep])
                self._pending = text[len(text) - keep :]
                return "".join(shown)
            if not self._in_call:
                shown.append(text[:at])
            text = text[at + len(tag) :]
            self._in_call = not self._in_call

    def flush(self) -> str:
        """End of stream: release a held false alarm; an unclosed block stays hidden."""
        rest = "" if self._in_call else self._pending
        self._pending = ""
        self._in_call = False
        return rest


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def tool_result_message(call: ToolCall, result: ToolResult) -> dict[str, str]:
    """The chat message that feeds ``result`` back to the model, in the Hermes convention.

    ChatML templates such as SmolLM2's render any role verbatim, so the ``<tool_response>``
    wrapper travels in the content. Refusals and errors are already spelled out in
    ``result.content``; the model reads them like any other result.
    """
    payload = json.dumps({"name": call.name, "content": result.content}, ensure_ascii=False)
    return {"role": "tool", "content": f"<tool_response>\n{payload}\n</tool_response>"}


def tools_system_prompt(specs: list[dict[str, Any]]) -> str:
    """The instructions appended to the system prompt: the tools and how to call them.

    Empty when there are no tools, so the caller can append it unconditionally.
    """
    if not specs:
        return ""
    listed = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in specs)
    return (
        "# Tools\n\n"
        "You can use tools to help with the user's request. Each tool is described by a JSON "
        "schema inside <tools></tools> tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To use a tool, write a JSON object with the tool's name and its arguments inside "
        "<tool_call></tool_call> tags, like this:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": "<tool name>", "arguments": {{"<argument>": <value>}}}}\n'
        f"{TOOL_CALL_CLOSE}\n"
        "Write one such block per call, then stop and wait. Each result comes back in a tool "
        "message inside <tool_response></tool_response> tags; read it before you continue. "
        "Only call the tools listed above, with the arguments their schemas describe."
    )
