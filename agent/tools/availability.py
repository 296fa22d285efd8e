"""Whether a session offers the model its tools: ``--tools auto|on|off``.

Tool schemas cost the prompt most of its tokens (about 480 of a one-shot prompt's 500 on the
default model) and a model that was not trained to call tools only gets confused by them: the
default SmolLM2-135M answers "tell me about rivers" with a dump of the ``list_dir`` schema. So
``auto`` offers tools only where the model can use them: remote backends (the served models
call tools through the OpenAI API), models whose registry entry says they call tools, and
models whose chat template renders tool definitions (Hermes/Qwen-style templates mention
``tools``). ``on`` offers them to any model, ``off`` to none. Recall stays a prompt section
either way.
"""

from dataclasses import dataclass
from typing import Any

TOOLS_SETTINGS = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class ToolsDecision:
    """What ``--tools`` resolved to for one model, and why (the ``--json`` result's ``tools``)."""

    setting: str  # auto / on / off, as given
    enabled: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "enabled": self.enabled, "reason": self.reason}


def model_calls_tools(backend_kind: str, model_name: str, tokenizer: Any) -> tuple[bool, str]:
    """Whether the model is known to call tools, and what says so."""
    from runtime.models.registry import lookup

    if backend_kind != "local":
        return True, f"a {backend_kind} backend serves tool calls"
    entry = lookup(model_name)
    if entry is not None:
        verb = "calls" if entry.calls_tools else "does not call"
        return entry.calls_tools, f"the registry entry {entry.name} {verb} tools"
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "tools" in template:
        return True, f"{model_name}'s chat template renders tools"
    return False, f"{model_name}'s chat template has no tool calls"


def decide_tools(setting: str, backend_kind: str, model_name: str, tokenizer: Any) -> ToolsDecision:
    if setting not in TOOLS_SETTINGS:
        raise ValueError(f"--tools must be one of {', '.join(TOOLS_SETTINGS)}, got {setting!r}")
    if setting == "on":
        return ToolsDecision(setting, True, "--tools on")
    if setting == "off":
        return ToolsDecision(setting, False, "--tools off")
    enabled, reason = model_calls_tools(backend_kind, model_name, tokenizer)
    return ToolsDecision(setting, enabled, reason)
