"""``liubai serve``: the HTTP server that puts the local engine behind OpenAI's API.

One engine, many clients, and no event loop of our own: the standard library's
``ThreadingHTTPServer`` gives each connection a thread, and each request thread calls
``engine.stream``, which already batches every thread's request into the same forward passes.
A streamed reply is server-sent events over HTTP/1.1 chunked encoding. A client that leaves is
noticed at its next delta (its socket reads as closed, or a write fails); closing the engine
stream then aborts its request, and the other clients never notice.

Endpoints: ``POST /v1/chat/completions`` and ``/v1/completions`` (streamed or not),
``GET /v1/models``, ``GET /health``, and ``GET /metrics``. This module owns the connection:
routing, authorization, bodies, chunked writes, shutdown. What a request body means and what
a reply looks like lives in :mod:`agent.openai_protocol`; what ``/metrics`` counts and how it is
written, in :mod:`agent.serve_metrics`. A bug is a one-line 500 whose traceback goes to the
server's log, never to the client.

Bounded on purpose: loopback only unless an API key is set, bodies up to ``max_body_bytes``,
and no prompt the model's context or the KV pool cannot hold.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import select
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import closing, contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import chain
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from agent.openai_protocol import (
    ApiError,
    GenerationRequest,
    Reply,
    completion_prompt,
    render_chat,
    sampling_params,
    stream_flags,
    usage,
)
from agent.serve_metrics import ServerMetrics
from runtime.errors import PromptTooLongError

if TYPE_CHECKING:
    from runtime.engine import CompletionDelta, Engine

DEFAULT_MAX_BODY_BYTES = 1024**2
# An unwanted body (of a request refused early) up to this size is read and dropped, so the
# connection can carry the client's next request; a larger one closes the connection.
MAX_DISCARD_BYTES = 16 * 1024**2
KEEPALIVE_TIMEOUT_S = 120.0  # an idle connection's thread ends after this long
SHUTDOWN_GRACE_S = 5.0  # how long shutdown waits for in-flight replies to notice and end
_ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("POST",),
    "/v1/completions": ("POST",),
    "/v1/models": ("GET",),
    "/v1/models/{id}": ("GET",),
    "/metrics": ("GET",),
    "/health": ("GET",),
}

logger = logging.getLogger("liubai.serve")


class _Abandoned(Exception):
    """The client left, or the server is stopping: end this reply without another byte."""


def one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def is_loopback(host: str) -> bool:
    """True when ``host`` names only this machine (127.0.0.0/8, ::1, or a name resolving to them)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0])).is_loopback for info in infos)


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without a key: anyone on the network could use the model."""
    if not api_key and not is_loopback(host):
        raise ValueError(
            f"refusing to listen on {host or 'all interfaces'} without an API key; "
            "set one with --api-key-env VAR, or bind to 127.0.0.1"
        )


class OpenAIServer:
    """One engine behind OpenAI's HTTP API. Binds at construction, so ``url`` is known at once
    (port 0 picks a free port); ``start()`` serves from a background thread, ``serve_forever()``
    from the caller's, and ``shutdown()`` stops either."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        check_bind(host, api_key)
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
        self.engine = engine
        self.model_name = model_name
        self.model_names = {model_name, engine.model_path.name}  # what a request's "model" may say
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.stopping = threading.Event()
        self._active = 0
        self._idle = threading.Condition()
        self._served = False
        self._closed = False
        self._thread: threading.Thread | None = None
        server_class = _HTTPServer6 if ":" in host else _HTTPServer
        self._httpd = server_class((host, port), self)

    @property
    def url(self) -> str:
        address = self._httpd.server_address
        host, port = str(address[0]), int(address[1])
        return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"

    def start(self) -> OpenAIServer:
        """Serve on a background thread; a second call does nothing (one thread per socket)."""
        if self._served:
            return self
        self._served = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="liubai-serve", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._served = True
        self._httpd.serve_forever(poll_interval=0.5)

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop accepting, end in-flight replies (aborting their engine requests), close the socket."""
        if self._closed:
            return
        self._closed = True
        self.stopping.set()
        if self._served:
            self._httpd.shutdown()  # returns at once if serve_forever already ended (Ctrl-C)
        if self._thread is not None:
            self._thread.join()
        with self._idle:
            self._idle.wait_for(lambda: self._active == 0, timeout=grace_s)
        self._httpd.server_close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Count a reply in flight, so that shutdown can wait for it."""
        with self._idle:
            self._active += 1
        try:
            yield
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    # -- what the endpoints do ----------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "liubai",
            "root": str(self.engine.model_path),
            "max_model_len": self.engine.max_model_len,
        }

    def parse(self, endpoint: str, body: dict[str, Any]) -> GenerationRequest:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model")
        if model is not None and model not in self.model_names:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                code="model_not_found",
                param="model",
            )
        param = "messages" if endpoint == "chat" else "prompt"
        if endpoint == "chat":
            prompt_ids = render_chat(self.engine.tokenizer, body.get("messages"))
        else:
            prompt_ids = completion_prompt(self.engine, body.get("prompt"))
        self._check_prompt_fits(prompt_ids, param)
        params = sampling_params(body, len(prompt_ids), self.engine.max_model_len)
        stream, include_usage = stream_flags(body)
        return GenerationRequest(endpoint, prompt_ids, params, stream, include_usage)

    def _check_prompt_fits(self, prompt_ids: list[int], param: str) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise ApiError(400, "the prompt is empty", param=param)
        # The engine's own bounds: the context keeps room for one new token, the pool holds the prompt.
        limit = min(self.engine.max_model_len - 1, self.engine.pool_capacity_tokens)
        if n > limit:
            raise ApiError(
                400,
                f"the prompt has {n} tokens; this server accepts at most {limit} "
                f"(model context {self.engine.max_model_len}, KV pool {self.engine.pool_capacity_tokens})",
                code="context_length_exceeded",
                param=param,
            )

    def generate(
        self, request: GenerationRequest, request_id: str, client_gone: Callable[[], bool]
    ) -> Generator[CompletionDelta, None, None]:
        """The engine's deltas, counted into the metrics. Stops with :class:`_Abandoned` when the
        client has gone or the server is stopping; closing this generator aborts the engine request."""
        started = time.perf_counter()
        # Engine.stream is a generator: closing it aborts the request (see its ``finally``).
        stream = cast(
            Generator["CompletionDelta", None, None],
            self.engine.stream(request.prompt_ids, request.params, request_id),
        )
        admitted = finished = False
        try:
            try:
                delta = next(stream)
            except PromptTooLongError as exc:  # the pre-check missed a bound the engine has
                raise ApiError(
                    400, str(exc), code="context_length_exceeded", param=request.prompt_param
                ) from exc
            admitted = True
            self.metrics.count_prompt(len(request.prompt_ids))
            while True:
                self.metrics.count_generated(len(delta.token_ids))
                if delta.finished:
                    finished = True
                    self.metrics.finish(
                        delta.finish_reason or "stop", delta.metrics, time.perf_counter() - started
                    )
                    yield delta
                    return
                yield delta
                if self.stopping.is_set() or client_gone():
                    raise _Abandoned()
                delta = next(stream)
        finally:
            stream.close()  # aborts the engine request unless it finished
            if admitted and not finished:
                self.metrics.finish("abort", None, time.perf_counter() - started)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # an idle keep-alive connection must not hold the process open

    def __init__(self, address: tuple[str, int], api: OpenAIServer) -> None:
        self.api = api
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the host's FQDN, a DNS query that can hang offline.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints the traceback to stderr; a client that hung up is not worth one.
        if isinstance(sys.exc_info()[1], ConnectionError):
            logger.debug("client %s hung up", client_address)
        else:
            logger.exception("connection from %s failed", client_address)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    """One connection: parse, route, reply. Everything the endpoints compute lives in OpenAIServer."""

    protocol_version = "HTTP/1.1"
    server_version = "liubai"
    timeout = KEEPALIVE_TIMEOUT_S
    _unread_body = 0  # bytes of the current request's body not yet read; -1: unknown (chunked)
    _streaming = False  # headers of a streamed reply are out: errors can only go into the stream

    @property
    def api(self) -> OpenAIServer:
        return cast(_HTTPServer, self.server).api

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def _dispatch(self, method: str) -> None:
        self._streaming = False
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        try:
            self._unread_body = -1 if chunked else max(0, int(self.headers.get("Content-Length") or 0))
        except ValueError:
            self._unread_body = -1
        try:
            try:
                if self.api.stopping.is_set():  # a kept-alive connection outliving the listener
                    self.close_connection = True
                    raise ApiError(503, "the server is shutting down", code="server_shutting_down")
                self._route(method)
            except ApiError as exc:
                self._send_error(exc)
            except _Abandoned:
                raise
            except Exception as exc:  # a bug: its traceback to the log, one line to the client
                logger.exception("%s %s failed", method, self.path)
                self._send_error(ApiError(500, f"internal server error: {one_line(exc)}"))
        except _Abandoned:
            self.close_connection = True

    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path
        path = path.rstrip("/") or "/"
        route = "/v1/models/{id}" if path.startswith("/v1/models/") else path
        allowed = _ROUTES.get(route)
        if allowed is None:
            raise ApiError(404, f"no such endpoint: {method} {path}", code="not_found")
        if path.startswith("/v1/"):
            self._authorize()
        if method not in allowed:
            raise ApiError(
                405,
                f"{method} is not allowed on {path}; use {', '.join(allowed)}",
                code="method_not_allowed",
                headers={"Allow": ", ".join(allowed)},
            )
        api = self.api
        if route == "/v1/chat/completions":
            self._complete("chat")
        elif route == "/v1/completions":
            self._complete("completion")
        elif route == "/v1/models":
            self._send_json(200, api.models())
        elif route == "/v1/models/{id}":
            name = path.removeprefix("/v1/models/")
            if name not in api.model_names:
                raise ApiError(404, f"The model `{name}` does not exist", code="model_not_found")
            self._send_json(200, api.model_card())
        elif route == "/metrics":
            text = api.metrics.render(api.engine.stats(), api.model_name).encode()
            self._send_bytes(200, text, "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send_json(200, {"status": "ok"})

    def _authorize(self) -> None:
        key = self.api.api_key
        if key is None:
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(
                401,
                "missing or incorrect API key; send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    # -- completions --------------------------------------------------------------------------

    def _complete(self, endpoint: str) -> None:
        api = self.api
        request = api.parse(endpoint, self._read_json())
        reply = Reply.new(request, api.model_name)
        with api.tracking(), closing(api.generate(request, reply.id, self._client_gone)) as deltas:
            first = next(deltas)  # admission errors are still ordinary error replies
            if request.stream:
                self._send_stream(request, reply, first, deltas)
                return
            texts, last = [], first
            for delta in chain([first], deltas):
                texts.append(delta.text)
                last = delta
            assert last.metrics is not None, "the engine's last delta carries the request metrics"
            self._send_json(
                200,
                reply.full("".join(texts), last.finish_reason, usage(len(request.prompt_ids), last.metrics)),
            )

    def _send_stream(
        self,
        request: GenerationRequest,
        reply: Reply,
        first: CompletionDelta,
        deltas: Iterator[CompletionDelta],
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._streaming = True
        events = [reply.chunk("", None, role=True)] if request.endpoint == "chat" else []
        try:
            for delta in chain([first], deltas):
                if delta.text or delta.finished:
                    events.append(reply.chunk(delta.text, delta.finish_reason))
                if delta.finished and request.include_usage:
                    assert delta.metrics is not None, "the engine's last delta carries the request metrics"
                    events.append(reply.usage_chunk(usage(len(request.prompt_ids), delta.metrics)))
                if events:
                    self._write_events(events)
                    events = []
        except _Abandoned:
            raise
        except Exception as exc:  # a bug mid-stream: the status is out, so the error goes in the stream
            logger.exception("stream %s failed", reply.id)
            self._write_events([ApiError(500, f"internal server error: {one_line(exc)}").to_dict()])
            self.close_connection = True
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_raw(b"0\r\n\r\n")

    def _client_gone(self) -> bool:
        """True once the client has closed its end: its socket is readable but holds no data."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # -- bodies -------------------------------------------------------------------------------

    def _read_json(self) -> dict[str, Any]:
        if self._unread_body < 0:
            raise ApiError(411, "send the request body with a Content-Length header", code="length_required")
        length = self._unread_body
        if length > self.api.max_body_bytes:
            raise ApiError(
                413,
                f"the request body has {length} bytes; this server accepts at most {self.api.max_body_bytes}",
                code="request_too_large",
            )
        raw = self.rfile.read(length)
        self._unread_body = 0
        if len(raw) < length:
            raise _Abandoned()
        try:
            body = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def _discard_body(self) -> None:
        """Read and drop an unread body so the connection can carry the next request; a body too
        large (or of unknown length) closes the connection instead."""
        if self._unread_body == 0:
            return
        if not 0 < self._unread_body <= MAX_DISCARD_BYTES:
            self.close_connection = True
            return
        try:
            while self._unread_body > 0:
                data = self.rfile.read(min(self._unread_body, 65536))
                if not data:
                    break
                self._unread_body -= len(data)
        except OSError:
            pass  # the client is gone; closing below is all that is left to do
        if self._unread_body:
            self.close_connection = True

    # -- writing ------------------------------------------------------------------------------

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's own errors (a malformed request line, an unknown method) in OpenAI's shape."""
        self._unread_body = -1
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        try:
            self._send_error(ApiError(code, message or phrase))
        except _Abandoned:
            self.close_connection = True

    def _send_error(self, error: ApiError) -> None:
        if self._streaming:
            self.close_connection = True
            return
        self._discard_body()
        self._send_json(error.status, error.to_dict(), error.headers)

    def _send_json(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._send_bytes(
            status, json.dumps(payload, ensure_ascii=False).encode(), "application/json", headers
        )

    def _send_bytes(
        self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self._write_raw(data)

    def _write_events(self, events: list[dict[str, Any]]) -> None:
        self._write_chunk(
            b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events)
        )

    def _write_chunk(self, data: bytes) -> None:
        self._write_raw(b"%x\r\n%b\r\n" % (len(data), data))

    def _write_raw(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
        except OSError as exc:  # BrokenPipe, ConnectionReset, a timed-out send: the client is gone
            raise _Abandoned() from exc

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def log_error(self, format: str, *args: Any) -> None:
        # The base class reports idle keep-alive timeouts and malformed request lines here: routine.
        logger.info("%s " + format, self.address_string(), *args)
