"""The listener: what happens on a client connection before the entrance sees a request.

aiohttp's server answers some requests itself, before any handler runs: a
request its HTTP parser refuses gets a plain-text 400 whose body quotes the
offending line (an ``Authorization`` header with its key, or the whole header
block) and a traceback with the same text on stderr. It bounds neither the
time a request's head may take nor the number of open connections, and keeps
an idle connection about an hour. This module replaces those answers and adds
the limits, all read once at start-up (a change needs a restart):

- A request the parser refuses is answered 400 ``bad_request`` with the
  proxy's error body, a fresh ``X-Request-Id`` and ``Connection: close``.
  Nothing the client sent is echoed; the log line names only the error's
  class; no traceback. A body the parser refuses once its head was handed on
  fails the body read with ``MalformedBody`` (400 ``bad_request``).
- ``server.header_ms``: a new connection must deliver a request line and all
  headers that soon after it opens; a kept-alive connection, that soon after
  the first byte of its next request. Nothing sent: the connection is closed
  without an answer. Part of a request: 408 ``entrance_timeout``, then closed.
  Sending a byte now and then does not extend it.
- ``server.keepalive_ms``: a kept-alive connection idle that long between
  requests is closed (aiohttp's own keep-alive timer, given this value).
- ``server.max_connections``: a connection that opens while that many are
  open has its request head read (still within ``header_ms``) and answered
  503 ``overloaded_connections`` with ``Connection: close``; no handler runs
  for it. Answering, rather than closing at accept, tells a client why.
  ``/healthz``, ``/readyz`` and ``/metrics`` are the exception: answered as
  usual, then closed (``UNCAPPED_PATHS``), so probes and scrapes still work.

Each answer given here is counted and logged like any request (tenant and
priority ``unknown``) through ``Telemetry.request_ended``: one access line,
one ``admission_requests_total`` increment.

Why subclasses of aiohttp's ``RequestHandler`` (``Connection``) and ``Server``
(``Listener``): the parser's answer is built in
``RequestHandler.handle_error``, which has no hook, and nothing in aiohttp
bounds the time a request head takes. Every reach into aiohttp's internals
is in ``Connection``; tests/test_probes_connections.py pins each behaviour
against a live listener (the parser's refusals with both the C parser and the
pure-Python one).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo
from aiohttp.web_request import BaseRequest

from proxy.entrance import error_response, request_id_of
from proxy.errors import (
    BadRequest,
    EntranceTimeout,
    OverloadedConnections,
    ProxyError,
)
from proxy.record import RequestRecord
from proxy.runtime import RUNTIME, Runtime
from proxy.settings import ServerConfig

log = structlog.get_logger(__name__)

#: Longest request line and longest header line, in bytes (aiohttp's defaults,
#: stated so that the documented limits cannot drift with aiohttp's).
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
#: Most header lines in one request.
MAX_HEADERS = 128
#: What the access line says for the method and path of a request never parsed.
UNPARSED = "-"
#: Reserved paths still answered on a connection beyond ``max_connections``: the
#: kubelet's probes and Prometheus' scrape open a new connection each time. Refused,
#: a proxy at its cap failed liveness (and was restarted, dropping every connection)
#: and went dark on its metrics exactly during the overload. Each is cheap, never
#: reaches a replica, and closes its connection after the answer.
UNCAPPED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class HeaderTimeout(Exception):
    """The request head did not arrive within ``server.header_ms``."""


class MalformedBody(BadRequest):
    """The parser refused a request's body after its head was handed on.

    Raised to whoever reads the body (the entrance answers it 400
    ``bad_request``); it quotes nothing of the body.
    """

    def __init__(self) -> None:
        super().__init__("malformed HTTP request body")


@dataclass(frozen=True, slots=True)
class Limits:
    """The listener's limits, in seconds and connections."""

    header_s: float
    keepalive_s: float
    max_connections: int

    @classmethod
    def from_config(cls, server: ServerConfig) -> Limits:
        return cls(server.header_ms / 1000.0, server.keepalive_ms / 1000.0, server.max_connections)


class ProxyRunner(web.AppRunner):
    """``AppRunner`` whose server is a ``Listener`` with the config's limits."""

    __slots__ = ("_limits",)

    def __init__(self, app: web.Application, server: ServerConfig, **kwargs: Any) -> None:
        limits = Limits.from_config(server)
        super().__init__(
            app,
            keepalive_timeout=limits.keepalive_s,
            max_line_size=MAX_LINE_BYTES,
            max_field_size=MAX_FIELD_BYTES,
            max_headers=MAX_HEADERS,
            **kwargs,
        )
        self._limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # runs the app's start-up, freezes it
        return Listener(server, self._limits, self.app[RUNTIME])


class Listener(web.Server):
    """aiohttp's ``Server`` handing out ``Connection``s and counting the open ones."""

    def __init__(self, server: web.Server, limits: Limits, runtime: Runtime) -> None:
        # Same handler, request factory and options as the app's own server.
        super().__init__(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            **server._kwargs,
        )
        self.limits = limits
        self.runtime = runtime
        #: Client connections open now (accepted, not yet lost).
        self.open = 0

    def __repr__(self) -> str:
        return f"<Listener {self.open} open, at most {self.limits.max_connections}>"

    def __call__(self) -> RequestHandler:
        return Connection(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.open += 1

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.open -= 1


class Connection(RequestHandler):
    """One client connection: aiohttp's handler with the proxy's answers and limits."""

    __slots__ = ("_app_handler", "_head_since", "_head_started", "_header_timer", "_listener")

    def __init__(self, manager: Listener, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._listener = manager
        self._app_handler = manager.request_handler
        self._request_handler = self._handle
        self._header_timer: asyncio.TimerHandle | None = None
        #: A byte of the awaited request head has arrived.
        self._head_started = False
        #: When the header clock started (``Runtime.clock``).
        self._head_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # counts it in the listener
        listener = self._listener
        if listener.open > listener.limits.max_connections:
            self._request_handler = self._refuse
        # A new connection's clock is header_ms, not aiohttp's keep-alive one.
        self._stop_keepalive_timer()
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None:
            self._head_started = self._head_started or bool(data)
            idle = False
        else:  # between requests, a kept-alive connection waits for the next one
            idle = bool(data) and self._waiter is not None and not self._waiter.done()
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a whole head came in (or the parser's error)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self._fail_body_in_progress()
        elif idle and not (self._close or self._force_close):
            # Part of the next request's head, the rest still to come: the
            # connection is no longer idle, and the head now has header_ms.
            # (A whole head in one read, the usual case, needs no timer.)
            self._stop_keepalive_timer()
            self._start_header_timer()
            self._head_started = True

    def _fail_body_in_progress(self) -> None:
        """A parser error while a request's body is still being read is that body's error.

        Without this, the C parser's error (a broken chunk) waits in the queue
        behind the request whose body will now never end, and the body read
        waits for ``entrance_ms``. (The pure-Python parser fails the body
        itself, with aiohttp's own exception.)
        """
        current = self._current_request
        if current is None or not self._messages or not isinstance(self._messages[-1][0], _ErrInfo):
            return
        body = current.content
        if not body.is_eof() and body.exception() is None:
            body.set_exception(MalformedBody())

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        self._head_started = False
        self._head_since = self._listener.runtime.clock.now()
        self._header_timer = self._loop.call_later(
            self._listener.limits.header_s, self._header_timeout
        )

    def _stop_keepalive_timer(self) -> None:
        """aiohttp re-arms it after the next response (it checks for ``None``)."""
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        waiter = self._waiter
        if self._force_close or self._close or waiter is None or waiter.done():
            return  # closing already, or the head is in and being handled
        if not self._head_started:
            self.force_close()
            return
        # Hand the loop in ``start`` an error in place of the request, as the
        # parser's own errors are handed over: it is answered by
        # ``handle_error`` and the connection closes after the answer.
        self._close = True  # read nothing more on this connection
        error = _ErrInfo(status=408, exc=HeaderTimeout(), message="")
        self._messages.append((error, EMPTY_PAYLOAD))
        self._request_count += 1
        waiter.set_result(None)

    def _handle(self, request: BaseRequest) -> Awaitable[web.StreamResponse]:
        """The app's handler, for a request whose target is a path.

        ``OPTIONS *`` and ``CONNECT host:port`` match no route: aiohttp would
        answer a plain-text 404 without the proxy's headers. Returning the
        app's coroutine itself (no extra ``await``) keeps this free for the
        usual request.
        """
        if request.raw_path[:1] != "/":
            return self._not_a_path(request)
        return self._app_handler(request)

    async def _not_a_path(self, request: BaseRequest) -> web.StreamResponse:
        error = BadRequest("the request target must be a path starting with /")
        return self._answer(error, request, parsed=True)

    async def _refuse(self, request: BaseRequest) -> web.StreamResponse:
        """The handler of a connection opened beyond ``max_connections``; probes and
        scrapes (``UNCAPPED_PATHS``) are answered, then the connection closes."""
        if request.path in UNCAPPED_PATHS:
            response = await self._app_handler(request)
            response.force_close()
            return response
        limit = self._listener.limits.max_connections
        error = OverloadedConnections(f"the proxy holds its limit of {limit} open connections")
        return self._answer(error, request, parsed=True)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Every answer aiohttp would make itself, as the proxy's error; ``message`` unused.

        ``message`` (and ``str(exc)``) may quote what the client sent, keys included.
        """
        if request.writer.output_size > 0:  # as aiohttp's: a second answer cannot be sent
            raise ConnectionError("response already started; cannot answer the error")
        error: ProxyError
        if isinstance(exc, HeaderTimeout):
            header_ms = round(self._listener.limits.header_s * 1000)
            error = EntranceTimeout(f"request headers not received within {header_ms} ms")
        elif isinstance(exc, HttpProcessingError) or status == 400:
            error = BadRequest("malformed HTTP request")
        else:
            error = ProxyError("internal error")
        parsed = not isinstance(error, (BadRequest, EntranceTimeout))
        return self._answer(error, request, parsed=parsed, exc=exc)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp's own error lines, without the exception's text (it may quote a header)."""
        exc = kw.get("exc_info")
        if isinstance(exc, MalformedBody):  # the rest of a refused body, read after the answer
            return
        if isinstance(exc, RequestPayloadError):
            # The client's body failed to parse or decode (a bad chunk, a gzip label on
            # bytes that are not): the entrance answered it 400; aiohttp meets the same
            # error again draining the rest. The client's fault, not an error here.
            log.info("request body refused", detail=str(args[0]) if args else None)
            return
        log.error(
            "server error",
            detail=str(args[0]) if args else None,
            error=type(exc).__name__ if isinstance(exc, BaseException) else None,
        )

    def _answer(
        self,
        error: ProxyError,
        request: BaseRequest,
        *,
        parsed: bool,
        exc: BaseException | None = None,
    ) -> web.Response:
        """The error response, counted and logged like a request that ended here.

        ``parsed``: the request line and headers are the client's, not aiohttp's
        placeholder for a request it could not parse.
        """
        runtime = self._listener.runtime
        now = runtime.clock.now()
        headers: Mapping[str, str] = {}
        if parsed and isinstance(request, web.Request):
            request_id = request_id_of(request)
            record = RequestRecord(request_id, now, method=request.method, path=request.path)
            headers = request.headers
        else:
            request_id = os.urandom(16).hex()
            record = RequestRecord(request_id, now, method=UNPARSED, path=UNPARSED)
        if isinstance(error, EntranceTimeout):
            record.arrival = self._head_since
        record.wall_arrival_ns = time.time_ns() - int((now - record.arrival) * 1e9)
        # Traced like a request the handler ends: the access line's trace_id names a span.
        record.trace = runtime.telemetry.tracing.start_request(headers, record)
        record.fail(error)
        record.entrance_done = now  # answered before any handler: all its time was here
        response = error_response(error, record)
        response.headers["Connection"] = "close"  # HTTP/1.0 answers get none from aiohttp
        response.force_close()
        record.end(now)
        runtime.telemetry.request_ended(record)
        fields = {
            "request_id": request_id,
            "peer": request.remote,
            "status": error.status,
            "reason": error.reason,
            "error": type(exc).__name__ if exc is not None else None,
        }
        if error.status >= 500 and not isinstance(error, OverloadedConnections):
            log.error("answered by the listener", **fields)
        else:
            log.info("answered by the listener", **fields)
        return response
