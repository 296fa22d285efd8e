"""``liubai serve``: the server that puts the local engine behind OpenAI's API.

One engine, many clients, and no event loop of our own: the standard library's
``ThreadingHTTPServer`` gives each connection a thread, and each request thread calls
``engine.stream``, which already batches every thread's request into the same forward passes.
A client that leaves is noticed at its next delta (its socket reads as closed, or a write fails);
closing the engine stream then aborts its request, and the other clients never notice.

Endpoints: ``POST /v1/chat/completions`` and ``/v1/completions`` (streamed or not),
``GET /v1/models``, ``GET /health``, and ``GET /metrics``. This module owns what the server does:
binding, the endpoints' work against this engine, shutdown. The connection (routing,
authorization, bodies, chunked writes, error replies) is :mod:`runtime.serve.http_server`; what a request
body means and what a reply looks like lives in :mod:`runtime.serve.protocol`; what ``/metrics``
counts and how it is written, in :mod:`runtime.serve.metrics`.

Bounded on purpose: loopback only unless an API key is set, bodies up to ``max_body_bytes``,
and no prompt the model's context or the KV pool cannot hold.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from runtime.errors import PromptTooLongError
from runtime.serve.http_server import Abandoned, HTTPServer, HTTPServer6
from runtime.serve.metrics import ServerMetrics
from runtime.serve.protocol import (
    ApiError,
    GenerationRequest,
    completion_prompt,
    render_chat,
    sampling_params,
    stream_flags,
)

if TYPE_CHECKING:
    from runtime.engine.engine import CompletionDelta, Engine

DEFAULT_MAX_BODY_BYTES = 1024**2
SHUTDOWN_GRACE_S = 5.0  # how long shutdown waits for in-flight replies to notice and end


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
        server_class = HTTPServer6 if ":" in host else HTTPServer
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

    def metrics_text(self) -> str:
        """``/metrics``: the server's counters and the engine's stats now, as Prometheus text."""
        return self.metrics.render(self.engine.stats(), self.model_name)

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
        """The engine's deltas, counted into the metrics. Stops with :class:`Abandoned` when the
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
                    raise Abandoned()
                delta = next(stream)
        finally:
            stream.close()  # aborts the engine request unless it finished
            if admitted and not finished:
                self.metrics.finish("abort", None, time.perf_counter() - started)
