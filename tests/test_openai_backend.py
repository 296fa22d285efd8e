"""The OpenAI-compatible client against a fake server written here with ``http.server``.

The fake listens on port 0 and plays whatever each test scripts: an SSE stream with or without
``usage``, an error status with an OpenAI (or vLLM) error body, a stalled or truncated stream.
It records every request, and notices when the client hangs up mid-stream.
"""

import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.session import default_budget
from memory import Budget
from runtime.backends.backend import Backend, ChatPrompt
from runtime.backends.openai_backend import BackendError, OpenAIBackend
from runtime.backends.token_counting import (
    TIKTOKEN_FILES,
    TokenCounter,
    tiktoken_file_ok,
    use_liubai_tiktoken_cache,
)
from runtime.engine.sampling import SamplingParams
from runtime.errors import EngineError

Reply = Callable[[BaseHTTPRequestHandler, dict[str, Any]], None]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


class FakeOpenAI:
    """A chat-completions server whose reply each test sets; it records what it was sent."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.reply: Reply = sse_reply(["Hello"])
        self.models: dict[str, Any] | None = None  # GET /v1/models' body; None answers 404
        self.gets: list[str] = []
        self.client_gone = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                try:
                    fake.reply(self, body)
                except (BrokenPipeError, ConnectionResetError):
                    fake.client_gone.set()

            def do_GET(self) -> None:
                fake.gets.append(self.path)
                if fake.models is None:
                    self.send_error(404)
                    return
                payload = json.dumps(fake.models).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    yield fake
    fake.close()


def chunk(content: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "chatcmpl-42", "object": "chat.completion.chunk", "choices": [choice], **extra}


def usage_chunk(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "chatcmpl-42", "object": "chat.completion.chunk", "choices": [], "usage": usage}


def sse_reply(
    pieces: list[str],
    usage: dict[str, Any] | None = None,
    delay_s: float = 0.0,
    finish: str = "stop",
    done: bool = True,
) -> Reply:
    """Stream a role chunk, one chunk per piece, a finish chunk, the usage chunk and [DONE]."""

    def reply(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        events: list[dict[str, Any] | str] = [chunk(""), *(chunk(p) for p in pieces), chunk(finish=finish)]
        if usage is not None:
            events.append(usage)
        handler.wfile.write(b": keep-alive\n\n")
        for event in events:
            if delay_s:
                time.sleep(delay_s)
            handler.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            handler.wfile.flush()
        if done:
            handler.wfile.write(b"data: [DONE]\n\n")

    return reply


def error_reply(status: int, body: dict[str, Any] | str) -> Reply:
    def reply(handler: BaseHTTPRequestHandler, request: dict[str, Any]) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return reply


def run(backend: OpenAIBackend, params: SamplingParams | None = None) -> list[Any]:
    return list(backend.stream(ChatPrompt(messages=list(MESSAGES)), params or SamplingParams(max_tokens=16)))


# --- the interface ------------------------------------------------------------------------


def test_is_a_backend_that_knows_no_kv(server: FakeOpenAI) -> None:
    backend: Backend = OpenAIBackend(server.url, "served-model")
    assert backend.kind == "openai" and backend.model_name == "served-model"
    assert backend.tokenizer is None
    assert backend.bytes_per_token is None
    assert backend.kv_dtypes == (None, None)
    assert backend.stats() is None


def test_context_length_comes_from_the_servers_model_card_once(server: FakeOpenAI) -> None:
    server.models = {
        "object": "list",
        "data": [
            {"id": "other-model", "object": "model", "max_model_len": 2048},
            {"id": "served-model", "object": "model", "max_model_len": 32768},
        ],
    }
    backend = OpenAIBackend(server.url + "/v1", "served-model")
    assert backend.max_context_tokens == 32768
    assert backend.max_context_tokens == 32768
    assert server.gets == ["/v1/models"]
    # The default budget of a session on it is that context; a larger one is capped at it.
    assert default_budget(backend) == "32768tok"
    assert Budget.from_spec("100000tok", None, backend.max_context_tokens).tokens == 32768


@pytest.mark.parametrize(
    "models",
    [None, {"data": [{"id": "served-model"}]}, {"data": [{"id": "x", "max_model_len": 99}]}, {"data": "?"}],
)
def test_a_server_that_does_not_say_leaves_the_context_unknown(
    server: FakeOpenAI, models: dict[str, Any] | None
) -> None:
    server.models = models
    backend = OpenAIBackend(server.url, "served-model")
    assert backend.max_context_tokens is None
    assert default_budget(backend) == "8192tok"


def test_an_unreachable_server_leaves_the_context_unknown() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert OpenAIBackend(f"http://127.0.0.1:{port}", "m").max_context_tokens is None


def test_rejects_a_bad_base_url() -> None:
    with pytest.raises(ValueError, match="base URL"):
        OpenAIBackend("localhost:8000", "m")


# --- streaming ------------------------------------------------------------------------------


def test_streams_text_and_reports_server_usage_with_cached_tokens(server: FakeOpenAI) -> None:
    server.reply = sse_reply(["Hel", "lo", " world"], usage=usage_chunk(12, 3, cached=8), delay_s=0.02)
    backend = OpenAIBackend(server.url, "served-model")

    deltas = run(backend)

    assert [d.text for d in deltas[:-1]] == ["Hel", "lo", " world"]
    assert not any(d.finished for d in deltas[:-1])
    final = deltas[-1]
    assert final.finished and final.finish_reason == "stop" and final.text == ""
    assert {d.request_id for d in deltas} == {"chatcmpl-42"}
    assert all(d.token_ids == [] for d in deltas)
    m = final.metrics
    assert (m.num_prompt_tokens, m.num_cached_tokens, m.num_prefilled_tokens) == (12, 8, 4)
    assert m.num_generated_tokens == 3
    assert backend.last_usage_source == "server"
    # The server waits 20 ms before each event: role, "Hel", "lo", " world".
    assert m.ttft_ms >= 35 and m.prefill_ms == m.ttft_ms
    assert len(m.inter_token_ms) == 2 and all(gap >= 15 for gap in m.inter_token_ms)
    assert m.decode_ms == pytest.approx(sum(m.inter_token_ms))


def test_usage_without_cache_details_means_no_cached_tokens(server: FakeOpenAI) -> None:
    server.reply = sse_reply(["Hi"], usage=usage_chunk(10, 1), finish="length")
    final = run(OpenAIBackend(server.url, "m"))[-1]
    assert final.finish_reason == "length"
    m = final.metrics
    assert (m.num_prompt_tokens, m.num_cached_tokens, m.num_prefilled_tokens, m.num_generated_tokens) == (
        10,
        0,
        10,
        1,
    )


def test_request_carries_sampling_params_and_key(server: FakeOpenAI) -> None:
    backend = OpenAIBackend(server.url + "/v1/", "served-model", api_key="sk-test")
    run(backend, SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["\n\n"]))
    run(backend, SamplingParams(max_tokens=7, top_k=5))

    first, second = server.requests
    assert first["path"] == "/v1/chat/completions"  # "/v1" in the base URL is not doubled
    assert first["headers"]["Authorization"] == "Bearer sk-test"
    assert first["body"] == {
        "model": "served-model",
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stop": ["\n\n"],
    }
    assert second["body"]["top_k"] == 5 and "seed" not in second["body"] and "stop" not in second["body"]


def test_no_usage_and_no_local_counter_is_an_estimate(server: FakeOpenAI) -> None:
    server.reply = sse_reply(["a", "b", "c", "d"])
    backend = OpenAIBackend(server.url, "mystery-model")
    m = run(backend)[-1].metrics
    chars = sum(len(msg["content"]) for msg in MESSAGES)
    assert (m.num_prompt_tokens, m.num_generated_tokens) == (math.ceil(chars / 4), 4)
    assert backend.last_usage_source == "estimate"


def test_no_usage_counts_with_the_local_tokenizer(server: FakeOpenAI, default_model_path: Path) -> None:
    server.reply = sse_reply(["Hello", " there", "!"])
    backend = OpenAIBackend(server.url, "smollm2", tokenizer_path=default_model_path)
    assert backend.tokenizer is not None

    m = run(backend)[-1].metrics

    counter = TokenCounter.for_model("smollm2", backend.tokenizer)
    assert m.num_prompt_tokens == counter.count_messages(MESSAGES).tokens  # type: ignore[union-attr]
    assert m.num_generated_tokens == counter.count_text("Hello there!").tokens  # type: ignore[union-attr]
    assert backend.last_usage_source == "tokenizer"


def test_no_usage_counts_with_tiktoken_for_openai_models(
    server: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    if not all(tiktoken_file_ok(name, use_liubai_tiktoken_cache()) for name in TIKTOKEN_FILES):
        pytest.skip("tiktoken encodings not pulled (liubai pull tiktoken)")
    server.reply = sse_reply(["hello", " world"])
    backend = OpenAIBackend(server.url, "gpt-4o")

    m = run(backend)[-1].metrics

    assert m.num_generated_tokens == 2  # o200k_base: "hello world" -> [24912, 2375]
    # 3 priming + per message 3 + role + content: system(1) "Be brief."(3), user(1) "Say hello."(3)
    assert m.num_prompt_tokens == 3 + (3 + 1 + 3) + (3 + 1 + 3)
    assert backend.last_usage_source == "tiktoken"


# --- errors -----------------------------------------------------------------------------------


def test_unauthorized_shows_status_and_server_message(server: FakeOpenAI) -> None:
    server.reply = error_reply(
        401,
        {"error": {"message": "Incorrect API key provided: sk-bad.", "type": "invalid_request_error"}},
    )
    with pytest.raises(BackendError) as caught:
        run(OpenAIBackend(server.url, "gpt-4o", api_key="sk-bad"))
    message = str(caught.value)
    assert "HTTP 401" in message and "Incorrect API key provided: sk-bad." in message
    assert "\n" not in message
    assert isinstance(caught.value, EngineError)


def test_vllm_flat_error_body_and_plain_text_body(server: FakeOpenAI) -> None:
    server.reply = error_reply(
        404, {"object": "error", "message": "The model `x` does not exist.", "code": 404}
    )
    with pytest.raises(BackendError, match=r"HTTP 404 .*The model `x` does not exist\."):
        run(OpenAIBackend(server.url, "x"))
    server.reply = error_reply(500, "Internal Server Error\n\nTraceback (most recent call last): ...")
    with pytest.raises(BackendError) as caught:
        run(OpenAIBackend(server.url, "x"))
    assert "HTTP 500" in str(caught.value) and "\n" not in str(caught.value)


def test_connection_refused() -> None:
    with socket.socket() as probe:  # a port nobody listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(BackendError, match="connection refused"):
        run(OpenAIBackend(f"http://127.0.0.1:{port}", "m"))


def test_a_silent_server_times_out(server: FakeOpenAI) -> None:
    def stall(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        time.sleep(1.0)

    server.reply = stall
    started = time.perf_counter()
    with pytest.raises(BackendError, match="sent nothing for 0.2 s"):
        run(OpenAIBackend(server.url, "m", timeout_s=0.2))
    assert time.perf_counter() - started < 0.9


def test_error_in_the_middle_of_the_stream(server: FakeOpenAI) -> None:
    def reply(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        handler.wfile.write(f"data: {json.dumps(chunk('Hel'))}\n\n".encode())
        error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
        handler.wfile.write(f"data: {json.dumps(error)}\n\n".encode())

    server.reply = reply
    deltas: list[Any] = []
    with pytest.raises(BackendError, match="engine died"):
        for delta in OpenAIBackend(server.url, "m").stream(ChatPrompt(MESSAGES), SamplingParams()):
            deltas.append(delta)
    assert [d.text for d in deltas] == ["Hel"]


def test_a_stream_cut_short_is_an_error(server: FakeOpenAI) -> None:
    def reply(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        handler.wfile.write(f"data: {json.dumps(chunk('Hel'))}\n\n".encode())

    server.reply = reply
    with pytest.raises(BackendError, match="closed the stream before the reply finished"):
        run(OpenAIBackend(server.url, "m"))


def test_api_key_from_the_environment(server: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIUBAI_TEST_KEY", raising=False)
    with pytest.raises(BackendError, match="LIUBAI_TEST_KEY is not set") as caught:
        OpenAIBackend.from_env(server.url, "m", "LIUBAI_TEST_KEY")
    assert "\n" not in str(caught.value)

    monkeypatch.setenv("LIUBAI_TEST_KEY", "sk-env")
    run(OpenAIBackend.from_env(server.url, "m", "LIUBAI_TEST_KEY"))
    run(OpenAIBackend.from_env(server.url, "m", None))
    with_key, without_key = server.requests
    assert with_key["headers"]["Authorization"] == "Bearer sk-env"
    assert "Authorization" not in without_key["headers"]


# --- cancellation -----------------------------------------------------------------------------


def test_closing_the_generator_closes_the_connection(server: FakeOpenAI) -> None:
    """vLLM aborts a request when its client hangs up; closing the stream must hang up."""
    server.reply = sse_reply([f"t{i} " for i in range(500)], delay_s=0.01)
    stream = OpenAIBackend(server.url, "m").stream(ChatPrompt(MESSAGES), SamplingParams())

    assert next(stream).text == "t0 "
    assert next(stream).text == "t1 "
    stream.close()

    # The server notices at its next write (a few ms), long before its 5 s of remaining chunks.
    assert server.client_gone.wait(timeout=3.0)
