"""A remote OpenAI-compatible server (vLLM, SGLang, llama.cpp, OpenAI) behind the Backend interface.

One streamed ``POST /v1/chat/completions`` per reply, spoken with the standard library only: the
request asks for ``stream_options.include_usage`` so the server's own token counts, and its
prefix-cache hits (``usage.prompt_tokens_details.cached_tokens``), arrive in the last chunk and
fill the same :class:`RequestMetrics` the local engine reports. Times are measured here, from the
request being sent, so they include the network. What the server does not report is counted
locally (:mod:`runtime.backends.token_counting`), and ``last_usage_source`` says where counts came from.

Each reply owns its connection. Closing the delta generator early closes the socket, which is
how a client tells vLLM and the others to abort a request.
"""

import http.client
import json
import math
import os
import socket
import time
import uuid
from collections.abc import Generator, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from runtime.backends.backend import ChatPrompt
from runtime.backends.token_counting import TokenCounter
from runtime.engine.engine import CompletionDelta
from runtime.engine.metrics import EngineStats, RequestMetrics
from runtime.engine.sampling import SamplingParams
from runtime.errors import EngineError, ModelError

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
_MODELS_TIMEOUT_S = 10.0  # the model list is optional information; a slow one is not waited for
_MODELS_BODY_LIMIT = 4 * 1024**2
_ERROR_BODY_LIMIT = 64 * 1024
_CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb, used only when nothing can count


class BackendError(EngineError):
    """The remote server could not be reached, refused the request, or broke off the stream."""


class OpenAIBackend:
    """A chat-completions client; ``stream`` yields text deltas and, last, the request's metrics."""

    kind = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 600,
        tokenizer_path: str | Path | None = None,
        *,
        fallback_encoding: str | None = None,
    ) -> None:
        parts = urlsplit(base_url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base URL must look like http://host:port or https://host, got {base_url!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout must be positive, got {timeout_s}")
        if not model:
            raise ValueError("a remote backend needs a model name")
        self.base_url = base_url.strip().rstrip("/")
        self.model_name = model
        self.timeout_s = float(timeout_s)
        self._api_key = api_key
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        # Accept both ``http://host:8000`` and the OpenAI SDK's ``http://host:8000/v1``.
        self._prefix = parts.path.rstrip("/").removesuffix("/v1")
        self._path = self._prefix + CHAT_PATH
        self._fallback_encoding = fallback_encoding
        self._tokenizer = _load_tokenizer(Path(tokenizer_path)) if tokenizer_path is not None else None
        self.last_usage_source: str | None = None  # "server", "tokenizer", "tiktoken" or "estimate"

    @classmethod
    def from_env(cls, base_url: str, model: str, api_key_env: str | None, **options: Any) -> "OpenAIBackend":
        """A backend whose API key is read from the environment variable ``api_key_env``."""
        api_key = None
        if api_key_env:
            api_key = os.environ.get(api_key_env)
            if not api_key:
                raise BackendError(
                    f"environment variable {api_key_env} is not set; it should hold the API key"
                )
        return cls(base_url, model, api_key=api_key, **options)

    @property
    def tokenizer(self) -> Any | None:
        return self._tokenizer

    @property
    def bytes_per_token(self) -> None:
        return None

    @property
    def kv_dtypes(self) -> tuple[None, None]:
        return None, None

    @property
    def weight_format(self) -> None:
        return None

    @property
    def compiled(self) -> None:
        return None

    @property
    def speculate(self) -> None:
        return None

    @property
    def wide_step_rows(self) -> None:
        return None

    @cached_property
    def max_context_tokens(self) -> int | None:
        """This model's context on the server, where its ``GET /v1/models`` card states one
        (``max_model_len``, as vLLM and ``liubai serve`` write it); asked once. None when the
        server does not say, or cannot be asked: the budget then stays as the user gave it."""
        for card in self._model_cards():
            if card.get("id") == self.model_name:
                length = card.get("max_model_len")
                return length if isinstance(length, int) and length > 0 else None
        return None

    def _model_cards(self) -> list[dict[str, Any]]:
        connection = self._connection(min(self.timeout_s, _MODELS_TIMEOUT_S))
        try:
            connection.request("GET", self._prefix + MODELS_PATH, headers=self._headers("application/json"))
            response = connection.getresponse()
            if response.status != 200:
                return []
            payload = json.loads(response.read(_MODELS_BODY_LIMIT))
        except (OSError, http.client.HTTPException, ValueError):
            return []
        finally:
            connection.close()
        data = payload.get("data") if isinstance(payload, dict) else None
        return [card for card in data if isinstance(card, dict)] if isinstance(data, list) else []

    def stats(self) -> EngineStats | None:
        return None

    @cached_property
    def counter(self) -> TokenCounter:
        """The local counter used when the server reports no usage (built on first need)."""
        return TokenCounter.for_model(
            self.model_name, self._tokenizer, fallback_encoding=self._fallback_encoding
        )

    def request_body(self, prompt: ChatPrompt, params: SamplingParams) -> dict[str, Any]:
        """The JSON body sent for ``prompt``; vLLM's extra fields only when they change something."""
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": prompt.messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.top_k:
            body["top_k"] = params.top_k
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.ignore_eos:
            body["ignore_eos"] = True
        if params.include_stop_str_in_output:
            body["include_stop_str_in_output"] = True
        return body

    def stream(self, prompt: ChatPrompt, params: SamplingParams) -> Generator[CompletionDelta, None, None]:
        """The reply's deltas; ``close()`` it to hang up, which makes the server abort the request."""
        if not prompt.messages:
            raise ValueError("a remote backend needs the prompt's chat messages")
        return self._stream(prompt, self.request_body(prompt, params))

    def _stream(self, prompt: ChatPrompt, body: dict[str, Any]) -> Generator[CompletionDelta, None, None]:
        conn = self._connection()
        response: http.client.HTTPResponse | None = None
        try:
            sent = time.perf_counter()
            try:
                conn.request("POST", self._path, body=json.dumps(body).encode(), headers=self._headers())
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise BackendError(self._connection_message(exc)) from exc
            if response.status // 100 != 2:
                raise BackendError(self._status_message(response))
            yield from self._deltas(response, prompt, sent)
        finally:
            # The response owns the socket once the server said it will close; close both.
            if response is not None:
                response.close()
            conn.close()

    def _deltas(
        self, response: http.client.HTTPResponse, prompt: ChatPrompt, sent: float
    ) -> Iterator[CompletionDelta]:
        request_id: str | None = None
        finish_reason: str | None = None
        usage: dict[str, Any] | None = None
        texts: list[str] = []
        times: list[float] = []  # perf_counter of each content chunk
        done = False
        try:
            for payload in _sse_data(response):
                if payload.strip() == "[DONE]":
                    done = True
                    break
                chunk = _parse_chunk(payload)
                request_id = request_id or chunk.get("id") or f"openai-{uuid.uuid4().hex[:12]}"
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        times.append(time.perf_counter())
                        texts.append(text)
                        yield CompletionDelta(request_id, [], text)
                    finish_reason = choice.get("finish_reason") or finish_reason
        except (OSError, http.client.HTTPException) as exc:
            raise BackendError(self._connection_message(exc)) from exc
        if not done and finish_reason is None:
            raise BackendError(f"{self.base_url} closed the stream before the reply finished")
        metrics = self._metrics(prompt, "".join(texts), len(texts), usage, sent, times)
        yield CompletionDelta(
            request_id or f"openai-{uuid.uuid4().hex[:12]}",
            [],
            "",
            finished=True,
            finish_reason=finish_reason or "stop",
            metrics=metrics,
        )

    def _metrics(
        self,
        prompt: ChatPrompt,
        text: str,
        num_chunks: int,
        usage: dict[str, Any] | None,
        sent: float,
        times: list[float],
    ) -> RequestMetrics:
        num_prompt, num_generated, num_cached, source = self._token_counts(prompt, text, num_chunks, usage)
        self.last_usage_source = source
        ttft_ms = (times[0] - sent) * 1000.0 if times else 0.0
        return RequestMetrics(
            num_prompt_tokens=num_prompt,
            num_cached_tokens=num_cached,
            num_prefilled_tokens=max(num_prompt - num_cached, 0),
            prefill_ms=ttft_ms,  # the server's prefill is not visible from here; ttft bounds it
            ttft_ms=ttft_ms,
            num_generated_tokens=num_generated,
            decode_ms=(times[-1] - times[0]) * 1000.0 if times else 0.0,
            inter_token_ms=[(b - a) * 1000.0 for a, b in zip(times, times[1:], strict=False)],
        )

    def _token_counts(
        self, prompt: ChatPrompt, text: str, num_chunks: int, usage: dict[str, Any] | None
    ) -> tuple[int, int, int, str]:
        """(prompt, generated, cached, source): the server's usage, else a local count, else a guess."""
        if usage is not None and "prompt_tokens" in usage and "completion_tokens" in usage:
            details = usage.get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or 0)
            return int(usage["prompt_tokens"]), int(usage["completion_tokens"]), cached, "server"
        counted_prompt = self.counter.count_messages(prompt.messages)
        counted_reply = self.counter.count_text(text)
        if counted_prompt is not None and counted_reply is not None:
            return counted_prompt.tokens, counted_reply.tokens, 0, counted_prompt.source
        # Servers stream about one token per chunk; the prompt gets OpenAI's 4-characters rule.
        chars = sum(len(m.get("content", "")) for m in prompt.messages)
        num_prompt = (
            len(prompt.token_ids) if prompt.token_ids is not None else math.ceil(chars / _CHARS_PER_TOKEN)
        )
        return num_prompt, num_chunks, 0, "estimate"

    def _connection(self, timeout_s: float | None = None) -> http.client.HTTPConnection:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _headers(self, accept: str = "text/event-stream") -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": accept,
            "User-Agent": "liubai",
        }
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def _connection_message(self, exc: BaseException) -> str:
        if isinstance(exc, ConnectionRefusedError):
            return f"cannot connect to {self.base_url}: connection refused (is the server running?)"
        if isinstance(exc, TimeoutError):
            return f"{self.base_url} sent nothing for {self.timeout_s:g} s; gave up"
        if isinstance(exc, socket.gaierror):
            return f"cannot resolve the host of {self.base_url}: {exc.strerror or exc}"
        if isinstance(exc, http.client.RemoteDisconnected):
            return f"{self.base_url} closed the connection without answering"
        return _one_line(f"connection to {self.base_url} failed: {type(exc).__name__}: {exc}")

    def _status_message(self, response: http.client.HTTPResponse) -> str:
        """``HTTP 401 Unauthorized from URL: <the server's error.message>``."""
        try:
            raw = response.read(_ERROR_BODY_LIMIT)
        except (OSError, http.client.HTTPException):
            raw = b""
        text = raw.decode("utf-8", errors="replace")
        message = _error_text(text) or response.reason or "no error message"
        return _one_line(f"HTTP {response.status} from {self.base_url}: {message}")


def _sse_data(response: http.client.HTTPResponse) -> Iterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined by newlines)."""
    lines: list[str] = []
    while True:
        raw = response.readline()
        if not raw:
            break
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
            continue
        if line.startswith(":"):  # a comment: keep-alive pings
            continue
        name, _, value = line.partition(":")
        if name == "data":
            lines.append(value.removeprefix(" "))
    if lines:
        yield "\n".join(lines)


def _parse_chunk(payload: str) -> dict[str, Any]:
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise BackendError(
            _one_line(f"the server sent a stream chunk that is not JSON: {payload[:120]}")
        ) from exc
    if not isinstance(chunk, dict):
        raise BackendError(
            _one_line(f"the server sent a stream chunk that is not an object: {payload[:120]}")
        )
    if "error" in chunk:  # vLLM and others report failures mid-stream this way
        raise BackendError(_one_line(f"the server failed mid-reply: {_error_text(payload) or payload[:200]}"))
    return chunk


def _error_text(body: str) -> str | None:
    """The message of an OpenAI error body (``{"error": {"message"}}``, or vLLM's flat ``message``)."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:200] or None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str) and error:
        return error
    if data.get("message"):
        return str(data["message"])
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    if not path.is_dir():
        raise ModelError(f"tokenizer directory not found: {path}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelError(_one_line(f"cannot load a tokenizer from {path}: {exc}")) from exc
