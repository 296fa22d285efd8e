"""The HTTP layer of ``liubai serve``: routing, the API key check, request bodies, replies.

Each connection gets a thread and a :class:`_Handler`, which routes a request, authorizes it, reads
its JSON body and writes the reply: a JSON body, or server-sent events over HTTP/1.1 chunked
encoding. Errors go out in OpenAI's shape; a bug is a one-line 500 whose traceback goes to the
server's log, never to the client.

Separate from :mod:`runtime.serve.server` so that what the server does
(:class:`~runtime.serve.server.OpenAIServer`: binding, the endpoints' work, shutdown) reads
without the wire protocol around it. This module only calls the server, through the
:class:`Endpoints` protocol it defines; the server imports this module, never the reverse.
"""

from __future__ import annotations

import hmac
import json
import logging
import select
import socket
import socketserver
import sys
import threading
from collections.abc import Callable, Generator, Iterator, Set
from contextlib import AbstractContextManager, closing
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import chain
from typing import TYPE_CHECKING, Any, Protocol, cast
from urllib.parse import urlsplit

from runtime.serve.protocol import ApiError, GenerationRequest, Reply, usage

if TYPE_CHECKING:
    from runtime.engine.engine import CompletionDelta

# An unwanted body (of a request refused early) up to this size is read and dropped, so the
# connection can carry the client's next request; a larger one closes the connection.
MAX_DISCARD_BYTES = 16 * 1024**2
KEEPALIVE_TIMEOUT_S = 120.0  # an idle connection's thread ends after this long
_ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("POST",),
    "/v1/completions": ("POST",),
    "/v1/models": ("GET",),
    "/v1/models/{id}": ("GET",),
    "/metrics": ("GET",),
    "/health": ("GET",),
}

# The server's logger, whichever of its modules writes: one name to configure or silence.
logger = logging.getLogger("liubai.serve")


class Abandoned(Exception):
    """The client left, or the server is stopping: end this reply without another byte."""


def one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class Endpoints(Protocol):
    """What a connection calls on the server (:class:`~runtime.serve.server.OpenAIServer`)."""

    @property
    def stopping(self) -> threading.Event: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def model_name(self) -> str: ...
    @property
    def model_names(self) -> Set[str]: ...

    def models(self) -> dict[str, Any]: ...
    def model_card(self) -> dict[str, Any]: ...
    def metrics_text(self) -> str: ...
    def parse(self, endpoint: str, body: dict[str, Any]) -> GenerationRequest: ...
    def tracking(self) -> AbstractContextManager[None]: ...
    def generate(
        self, request: GenerationRequest, request_id: str, client_gone: Callable[[], bool]
    ) -> Generator[CompletionDelta, None, None]: ...


class HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # an idle keep-alive connection must not hold the process open

    def __init__(self, address: tuple[str, int], api: Endpoints) -> None:
        self.api = api
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # http.server.HTTPServer.server_bind looks up the host's FQDN, a DNS query that can hang offline.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints the traceback to stderr; a client that hung up is not worth one.
        if isinstance(sys.exc_info()[1], ConnectionError):
            logger.debug("client %s hung up", client_address)
        else:
            logger.exception("connection from %s failed", client_address)


class HTTPServer6(HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    """One connection: parse, route, reply. Everything the endpoints compute lives in OpenAIServer."""

    protocol_version = "HTTP/1.1"
    server_version = "liubai"
    timeout = KEEPALIVE_TIMEOUT_S
    _unread_body = 0  # bytes of the current request's body not yet read; -1: unknown (chunked)
    _streaming = False  # headers of a streamed reply are out: errors can only go into the stream

    @property
    def api(self) -> Endpoints:
        return cast(HTTPServer, self.server).api

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
            except Abandoned:
                raise
            except Exception as exc:  # a bug: its traceback to the log, one line to the client
                logger.exception("%s %s failed", method, self.path)
                self._send_error(ApiError(500, f"internal server error: {one_line(exc)}"))
        except Abandoned:
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
            text = api.metrics_text().encode()
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
        except Abandoned:
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
            raise Abandoned()
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
        except Abandoned:
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
            raise Abandoned() from exc

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def log_error(self, format: str, *args: Any) -> None:
        # The base class reports idle keep-alive timeouts and malformed request lines here: routine.
        logger.info("%s " + format, self.address_string(), *args)
