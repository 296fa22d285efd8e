"""What running a tool call produced, as one value the registry returns and the loop feeds back.

Its own module because both halves of a tool call use it: :mod:`agent.tools.registry` makes
one for every run, and :mod:`agent.tools.calls` writes one back into the conversation. Neither
of those needs the other for it, so they do not import each other.
"""

from dataclasses import dataclass


@dataclass(slots=True)
class ToolResult:
    """What a tool run produced: ``content`` is exactly what the model will read."""

    ok: bool
    content: str
    refused: bool = False
    truncated: bool = False
    duration_ms: float = 0.0
