"""OpenAI's request and reply shapes, apart from HTTP: what a body may say and what comes back.

Parsing turns a request body into a :class:`GenerationRequest` (prompt token ids and engine
``SamplingParams``) or raises :class:`ApiError`, which carries the HTTP status and renders
OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``. :class:`Reply` builds the
response bodies and stream chunks of either endpoint (chat or completion) from the engine's text.
No sockets here, so the server module only routes and writes bytes, and each shape can be read
against OpenAI's reference on its own. Unsupported fields (``n > 1``, ``logprobs``, ``tools``...)
are refused with a 400 naming the field, never silently ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from jinja2 import TemplateError

from runtime.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from runtime.engine.engine import Engine
    from runtime.engine.metrics import RequestMetrics

_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error reply: an HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# --- requests --------------------------------------------------------------------------------


@dataclass(slots=True)
class GenerationRequest:
    """One validated completion request, ready for the engine."""

    endpoint: str  # "chat" or "completion"
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False

    @property
    def prompt_param(self) -> str:
        return "messages" if self.endpoint == "chat" else "prompt"


def _optional(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {what}", param=name)
    return value


def _int(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value: int | None = _optional(body, name, (int,), "an integer")
    if value is not None and minimum is not None and value < minimum:
        raise ApiError(400, f"'{name}' must be at least {minimum}, got {value}", param=name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = _optional(body, name, (int, float), "a number")
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return None if value is None else float(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    return bool(_optional(body, name, (bool,), "true or false"))


def _message_text(content: Any, index: int) -> str:
    """A message's text: a string, null, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "\n".join(cast(list[str], texts))
    raise ApiError(
        400, f"messages[{index}].content must be a string or a list of text parts", param="messages"
    )


def render_chat(tokenizer: Any, messages: Any) -> list[int]:
    """Chat messages as the model expects them: its chat template with the assistant turn opened,
    tokenized without extra special tokens because the template placed them (as ``liubai run``)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    rendered: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(_ROLES)}", param="messages")
        rendered.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _message_text(message.get("content"), i),
            }
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError) as exc:
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def completion_prompt(engine: Engine, prompt: Any) -> list[int]:
    """``prompt`` as token ids: a string (tokenized like ``engine.generate`` does), a list of token
    ids, or a one-element list of either; several prompts in one request are not supported."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return engine.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        vocab_size = getattr(engine.model.config, "vocab_size", None)
        if vocab_size is not None and not all(0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"token ids must be in [0, {vocab_size})", param="prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "only one prompt per request is supported", param="prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")


def sampling_params(body: dict[str, Any], num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """OpenAI's sampling fields (and vLLM's ``top_k`` and ``ignore_eos``) as engine parameters."""
    if _int(body, "n") not in (None, 1):
        raise ApiError(400, "only n=1 is supported", param="n")
    if _int(body, "best_of") not in (None, 1):
        raise ApiError(400, "only best_of=1 is supported", param="best_of")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools"):
        if body.get(name):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
            "in the completion). Please reduce the length of the prompt or completion.",
            code="context_length_exceeded",
            param="max_tokens",
        )
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,  # OpenAI's default
            top_p=1.0 if top_p is None else top_p,
            top_k=_int(body, "top_k", 0) or 0,
            seed=_int(body, "seed"),
            stop=stop or [],
            ignore_eos=_bool(body, "ignore_eos"),
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """``(stream, include_usage)``: whether to stream, and whether the last chunk carries usage."""
    stream = _bool(body, "stream")
    options = _optional(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise ApiError(400, "'stream_options' is only allowed with stream=true", param="stream_options")
    return stream, options is not None and _bool(options, "include_usage")


# --- replies ---------------------------------------------------------------------------------


def usage(num_prompt_tokens: int, metrics: RequestMetrics) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": metrics.num_generated_tokens,
        "total_tokens": num_prompt_tokens + metrics.num_generated_tokens,
        "prompt_tokens_details": {"cached_tokens": metrics.num_cached_tokens},
    }


@dataclass(slots=True)
class Reply:
    """The fixed fields of one response, and the shape of its bodies for either endpoint."""

    endpoint: str
    id: str
    model: str
    created: int
    include_usage: bool

    @classmethod
    def new(cls, request: GenerationRequest, model: str) -> Reply:
        prefix = "chatcmpl" if request.endpoint == "chat" else "cmpl"
        return cls(
            request.endpoint, f"{prefix}-{uuid.uuid4().hex}", model, int(time.time()), request.include_usage
        )

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        if self.endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text}
            body = self._head("text_completion")
        choice.update(logprobs=None, finish_reason=finish_reason)
        return {**body, "choices": [choice], "usage": usage}

    def chunk(self, text: str, finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
        if self.endpoint == "chat":
            delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text}
            body = self._head("text_completion")
        choice.update(logprobs=None, finish_reason=finish_reason)
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None  # as OpenAI does: only the last chunk carries usage
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}
