"""``liubai serve`` end to end: the official openai client against :class:`OpenAIServer` on the real
default model.

One engine for the module, served in-process on a free port. The tests speak HTTP to it as any
client would (the openai client, or a raw socket where a client must misbehave), and read the
engine's own stats to see what happened behind the API: that greedy replies are the engine's
tokens, that a departed client's request is aborted, that concurrent clients share forward passes.
"""

import argparse
import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from agent.cli.serve import add_parser, run
from runtime import Completion, Engine, SamplingParams
from runtime.serve.server import OpenAIServer, is_loopback

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three rivers in Europe."},
]
TEXT_PROMPT = "The three oldest libraries in the world are"


@pytest.fixture(scope="module")
def engine(default_model_path: Path) -> Engine:
    return Engine(model=default_model_path, kv_pool="64MiB", dtype="float32")  # /metrics names the format


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[OpenAIServer]:
    with OpenAIServer(engine, MODEL, port=0) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> openai.OpenAI:
    return make_client(server)


@pytest.fixture(scope="module")
def chat_reference(engine: Engine) -> Completion:
    """What the engine itself answers to MESSAGES, rendered with the chat template."""
    text = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return engine.generate(ids, SamplingParams(max_tokens=16))[0]


def make_client(server: OpenAIServer, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=api_key, max_retries=0, timeout=60)


# --- raw HTTP ----------------------------------------------------------------------------------


def address(server: OpenAIServer) -> tuple[str, int]:
    parts = urlsplit(server.url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def request(
    server: OpenAIServer,
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    conn: http.client.HTTPConnection | None = None,
) -> tuple[int, dict[str, str], bytes]:
    conn = conn or http.client.HTTPConnection(*address(server), timeout=60)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


def assert_openai_error(raw: bytes, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape exactly, with a one-line message and no traceback."""
    payload = json.loads(raw)
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and "\n" not in error["message"]
    assert "Traceback" not in error["message"]
    assert error["type"] in ("invalid_request_error", "server_error")
    if code is not None:
        assert error["code"] == code
    return dict(error)


def streaming_socket(server: OpenAIServer, body: dict[str, Any]) -> socket.socket:
    """A raw connection that has sent a streaming chat request."""
    data = json.dumps({"model": MODEL, "stream": True, **body}).encode()
    sock = socket.create_connection(address(server), timeout=60)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_events(sock: socket.socket, count: int) -> bytes:
    received = b""
    while received.count(b"data: ") < count:
        data = sock.recv(4096)
        assert data, f"the server closed the stream after {received!r}"
        received += data
    return received


def wait_until(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        time.sleep(0.02)


# --- Prometheus text ---------------------------------------------------------------------------

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_prometheus(text: str) -> tuple[dict[str, str], Samples]:
    """A strict reader of the Prometheus text format 0.0.4: every family has HELP then TYPE before
    its samples, counters end in ``_total``, histogram buckets are cumulative up to ``+Inf``.
    Returns ({family: type}, {(sample name, labels): value})."""
    assert text.endswith("\n")
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    samples: Samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[len("# HELP ") :].partition(" ")
            assert name not in helps and doc, line
            helps[name] = doc
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE ") :].split(" ")
            assert name in helps and name not in types, f"TYPE without its HELP first, or twice: {line}"
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
        else:
            match = _SAMPLE.fullmatch(line)
            assert match, f"not a sample line: {line!r}"
            name, raw_labels, raw_value = match.groups()
            labels: dict[str, str] = {}
            pos = 0
            while raw_labels and pos < len(raw_labels):
                label = _LABEL.match(raw_labels, pos)
                assert label, f"bad labels in {line!r}"
                labels[label.group(1)] = label.group(2)
                pos = label.end()
            family = name if name in types else re.sub(r"_(bucket|sum|count)$", "", name)
            assert family in types, f"sample before its TYPE: {line}"
            if types[family] == "counter":
                assert name.endswith("_total"), line
            if types[family] == "histogram":
                assert name != family and ("le" in labels) == name.endswith("_bucket"), line
            key = (name, frozenset(labels.items()))
            assert key not in samples, f"duplicate sample {line}"
            samples[key] = float(raw_value)
    for family in (f for f, kind in types.items() if kind == "histogram"):
        buckets = sorted(
            (
                (float(dict(labels)["le"]), value)
                for (n, labels), value in samples.items()
                if n == f"{family}_bucket"
            ),
        )
        counts = [value for _, value in buckets]
        assert buckets and buckets[-1][0] == float("inf") and counts == sorted(counts), family
        assert counts[-1] == value_of(samples, f"{family}_count"), family
    return types, samples


def value_of(samples: Samples, name: str, **labels: str) -> float:
    matching = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert matching, f"no sample {name} {labels}"
    return sum(matching)


def scrape(server: OpenAIServer) -> Samples:
    status, headers, raw = request(server, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return parse_prometheus(raw.decode())[1]


# --- the API through the official client -------------------------------------------------------


def test_chat_completion_equals_engine_generate(client: openai.OpenAI, chat_reference: Completion) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert choice.message.role == "assistant"
    assert choice.message.content == chat_reference.text
    assert choice.finish_reason == chat_reference.finish_reason
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(chat_reference.prompt_token_ids)
    assert reply.usage.completion_tokens == len(chat_reference.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_equals_engine_generate_and_ends_with_usage(
    client: openai.OpenAI, chat_reference: Completion
) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_reference.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [chat_reference.finish_reason]
    *body, last = chunks
    assert last.choices == [] and all(c.usage is None for c in body)
    assert last.usage is not None and last.usage.completion_tokens == len(chat_reference.token_ids)


def test_completions_equal_engine_generate(engine: Engine, client: openai.OpenAI) -> None:
    expected = engine.generate(TEXT_PROMPT, SamplingParams(max_tokens=12))[0]
    reply = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=12, temperature=0)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    streamed = client.completions.create(
        model=MODEL, prompt=expected.prompt_token_ids, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_stop_strings_and_seeded_sampling(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=12, temperature=0)
    text = full.choices[0].text
    word = next(w for w in text.split() if text.index(w) > 0)
    stopped = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPT, max_tokens=12, temperature=0, stop=[word]
    )
    assert stopped.choices[0].text == text[: text.index(word)]
    assert stopped.choices[0].finish_reason == "stop"
    sampled = [
        client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=8, temperature=1.0, seed=7)
        for _ in range(2)
    ]
    assert sampled[0].choices[0].text == sampled[1].choices[0].text


def test_models_lists_the_served_name(client: openai.OpenAI, engine: Engine) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_shared_prefix_reports_cached_tokens(client: openai.OpenAI) -> None:
    system = "You keep the ledgers of a river town and answer questions about them. " * 12
    replies = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        for question in ("Which boats arrived in spring?", "How much salt was sold in winter?")
    ]
    cached = []
    for reply in replies:
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
    assert cached[0] == 0
    assert cached[1] >= 160 and cached[1] % 16 == 0  # whole blocks of the ~190-token shared system prompt


def test_metrics_are_prometheus_text_and_move_with_traffic(
    server: OpenAIServer, client: openai.OpenAI
) -> None:
    status, _, raw = request(server, "GET", "/metrics")
    types, _ = parse_prometheus(raw.decode())
    assert {
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:prefix_cache_queries_total": "counter",
        "vllm:prefix_cache_hits_total": "counter",
        "vllm:num_preemptions_total": "counter",
        "vllm:prompt_tokens_total": "counter",
        "vllm:generation_tokens_total": "counter",
        "vllm:request_success_total": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "liubai:weights_info": "gauge",
        "liubai:decode_compiled": "gauge",
        "vllm:spec_decode_num_drafts_total": "counter",
        "vllm:spec_decode_num_draft_tokens_total": "counter",
        "vllm:spec_decode_num_accepted_tokens_total": "counter",
    }.items() <= types.items()
    assert 'liubai:weights_info{model_name="' in raw.decode() and 'format="float32"} 1' in raw.decode()

    before = scrape(server)
    reply = client.completions.create(
        model=MODEL,
        prompt="Count with me: one, two,",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = scrape(server)
    assert reply.usage is not None and reply.usage.completion_tokens == 8

    def moved(name: str, **labels: str) -> float:
        return value_of(after, name, model_name=MODEL, **labels) - value_of(before, name, **labels)

    assert moved("vllm:request_success_total", finished_reason="length") == 1
    assert moved("vllm:request_success_total", finished_reason="stop") == 0
    assert moved("vllm:prompt_tokens_total") == reply.usage.prompt_tokens
    assert moved("vllm:generation_tokens_total") == 8
    assert moved("vllm:prefix_cache_queries_total") == reply.usage.prompt_tokens
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:inter_token_latency_seconds_count") == 7
    assert value_of(after, "vllm:num_requests_running") == 0
    assert 0 <= value_of(after, "vllm:kv_cache_usage_perc") <= 1
    assert moved("vllm:spec_decode_num_drafts_total") == 0  # the engine does not speculate by default


def test_metrics_count_speculative_guesses(server: OpenAIServer, engine: Engine) -> None:
    """The spec_decode counters are the engine's totals: a request that speculates (prompt lookup
    over a list to repeat) moves them by what its own metrics counted."""
    prompt = "Repeat exactly: red, green, blue, red, green, blue, red, green, blue, red, green,"
    before = scrape(server)
    [completion] = engine.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True, speculate="ngram"))
    after = scrape(server)
    m = completion.metrics
    assert m.num_drafts > 0

    def moved(name: str) -> float:
        return value_of(after, name, model_name=MODEL) - value_of(before, name, model_name=MODEL)

    assert moved("vllm:spec_decode_num_drafts_total") == m.num_drafts
    assert moved("vllm:spec_decode_num_draft_tokens_total") == m.num_draft_tokens
    assert moved("vllm:spec_decode_num_accepted_tokens_total") == m.num_accepted_tokens


# --- bad input ---------------------------------------------------------------------------------


BAD_REQUESTS: list[tuple[bytes | dict[str, Any], int, str | None, str | None]] = [
    (b'{"model": ', 400, "invalid_json", None),
    (b"[1, 2]", 400, "invalid_json", None),
    ({"model": "gpt-4o", "messages": MESSAGES}, 404, "model_not_found", "model"),
    ({"model": MODEL}, 400, None, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None, "messages"),
    ({"model": MODEL, "messages": MESSAGES, "n": 2}, 400, None, "n"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, 400, None, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, 400, None, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "stop": [1]}, 400, None, "stop"),
    ({"model": MODEL, "messages": MESSAGES, "stream_options": {}}, 400, None, "stream_options"),
    (
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 10**6},
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "archive " * 4000}]},
        400,
        "context_length_exceeded",
        "messages",
    ),
]


@pytest.mark.parametrize(("body", "status", "code", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(
    server: OpenAIServer, body: bytes | dict[str, Any], status: int, code: str | None, param: str | None
) -> None:
    got, _, raw = request(server, "POST", "/v1/chat/completions", body)
    assert got == status
    error = assert_openai_error(raw, code)
    assert error["param"] == param


def test_oversized_prompt_through_the_client(client: openai.OpenAI, engine: Engine) -> None:
    too_long = [100] * (engine.pool_capacity_tokens + 1)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=4)
    assert caught.value.code == "context_length_exceeded"


def test_oversized_body_is_413_and_the_connection_survives(server: OpenAIServer) -> None:
    conn = http.client.HTTPConnection(*address(server), timeout=60)
    status, _, raw = request(server, "POST", "/v1/completions", b" " * (server.max_body_bytes + 1), conn=conn)
    assert status == 413
    assert_openai_error(raw, "request_too_large")
    status, _, raw = request(server, "GET", "/v1/models", conn=conn)
    assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL


def test_unknown_path_and_wrong_method(server: OpenAIServer) -> None:
    status, _, raw = request(server, "GET", "/v1/embeddings")
    assert status == 404
    assert_openai_error(raw, "not_found")
    status, headers, raw = request(server, "GET", "/v1/chat/completions")
    assert status == 405 and headers["Allow"] == "POST"
    assert_openai_error(raw, "method_not_allowed")


def test_api_key_is_required_when_set(engine: Engine) -> None:
    with OpenAIServer(engine, MODEL, port=0, api_key="s3cret") as keyed:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, _, raw = request(keyed, "GET", "/v1/models", headers=headers)
            assert status == 401
            assert_openai_error(raw, "invalid_api_key")
        status, _, _ = request(keyed, "POST", "/v1/completions", {"prompt": "hi"})
        assert status == 401
        with pytest.raises(openai.AuthenticationError):
            make_client(keyed, "wrong").models.list()
        assert [m.id for m in make_client(keyed, "s3cret").models.list()] == [MODEL]


def test_binding_beyond_loopback_needs_a_key(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("")
    with pytest.raises(ValueError, match="API key"):
        OpenAIServer(engine, MODEL, host="0.0.0.0", port=0)
    OpenAIServer(engine, MODEL, host="0.0.0.0", port=0, api_key="s3cret").shutdown()

    parser = argparse.ArgumentParser(prog="liubai")
    add_parser(parser.add_subparsers(dest="command"))
    monkeypatch.delenv("LIUBAI_TEST_SERVE_KEY", raising=False)
    # Both are refused before any model is loaded.
    with pytest.raises(ValueError, match="API key"):
        run(parser.parse_args(["serve", "--host", "0.0.0.0", "--port", "0"]))
    with pytest.raises(ValueError, match="LIUBAI_TEST_SERVE_KEY"):
        run(parser.parse_args(["serve", "--api-key-env", "LIUBAI_TEST_SERVE_KEY"]))
    args = parser.parse_args(["serve", "--port", "0", "--max-body-bytes", "64KiB"])
    assert args.handler is run and args.max_body_bytes == 65536 and args.model == MODEL
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--port", "70000"])


# --- clients that leave, clients that overlap --------------------------------------------------


def test_client_that_disconnects_mid_stream_is_aborted(
    engine: Engine, server: OpenAIServer, client: openai.OpenAI
) -> None:
    aborted = server.metrics.request_success["abort"]
    sock = streaming_socket(
        server, {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    )
    received = read_events(sock, 3)  # the role chunk and two content chunks
    sock.close()
    wait_until(lambda: server.metrics.request_success["abort"] == aborted + 1)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert b"[DONE]" not in received
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason == "length"


def test_two_concurrent_streams_share_forward_passes(engine: Engine, server: OpenAIServer) -> None:
    barrier = threading.Barrier(2)
    spans: dict[int, tuple[float, float, int]] = {}

    def stream(index: int) -> None:
        own = make_client(server)
        barrier.wait()
        chunks = own.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Tell story number {index} about a lighthouse."}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        first = last = 0.0
        usage = 0
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                last = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        spans[index] = (first, last, usage)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(spans) == [0, 1] and all(usage == 24 for _, _, usage in spans.values())
    (first_a, last_a, _), (first_b, last_b, _) = spans.values()
    assert first_a < last_b and first_b < last_a, "the two streams did not overlap"
    assert engine.stats().max_batch_size >= 2


def test_shutdown_ends_streams_and_frees_the_engine(engine: Engine) -> None:
    stopping = OpenAIServer(engine, MODEL, port=0).start()
    idle = http.client.HTTPConnection(*address(stopping), timeout=60)
    assert request(stopping, "GET", "/health", conn=idle)[0] == 200
    sock = streaming_socket(stopping, {"messages": MESSAGES, "max_tokens": 24, "ignore_eos": True})
    read_events(sock, 2)
    stopping.shutdown()
    status, _, raw = request(stopping, "GET", "/v1/models", conn=idle)  # kept alive past shutdown
    assert status == 503
    assert_openai_error(raw, "server_shutting_down")
    wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0)
    assert stopping.metrics.request_success["abort"] == 1
    rest = b""
    while data := sock.recv(4096):
        rest += data
    assert b"[DONE]" not in rest  # the stream was cut, not completed
    sock.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address(stopping), timeout=5)
