"""One upstream attempt, up to its commit point (the first body byte), and the reads after it.

This is the only module that knows aiohttp's client exceptions: each is
translated here into a ``ProxyError`` (``raise ... from exc``), so the layers
above reason about outcomes and retry classes, never about library types.

An attempt is bounded by three clocks: the connect timeout (aiohttp's
``sock_connect``), the first-byte budget for streaming requests (dispatch to
the first upstream body byte, clipped to the total), and the total deadline.
A non-streaming answer's first byte comes only when it is complete, so those
are bounded by the total alone (docs/REFERENCE.md).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from proxy.admitted import Deadline
from proxy.clock import Clock
from proxy.errors import (
    ConnectTimeout,
    FirstByteTimeout,
    IdleTimeout,
    ProxyError,
    ResetBeforeFirstByte,
    TotalTimeout,
    UpstreamConnectError,
    UpstreamProtocolError,
)
from proxy.replicas import Replica

#: Connections the shared client session may hold open at once. aiohttp's
#: default of 100 would silently queue requests inside the connector.
CONNECTOR_LIMIT = 4096
#: aiohttp adds its own ``User-Agent`` to a request without one; the client's
#: absence of one is forwarded as is. (Asked per request, only then: a
#: session-wide skip list costs every request something in aiohttp.)
NO_USER_AGENT = ("User-Agent",)


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """What is sent to a replica; built once at the entrance, reused per attempt."""

    method: str
    path_qs: str
    headers: CIMultiDict[str]
    body: bytes
    streaming: bool
    #: May go out again when a pooled connection turns out dead before any
    #: answer (inference routes: a repeat before the first byte is safe).
    resend_on_stale: bool = False


class Expiry:
    """``asyncio.timeout(delay)`` as a plain context manager: same contract, less work.

    Entered with ``with`` inside a task; when ``delay`` passes first, the
    task is cancelled and the block ends in ``TimeoutError``. As in
    ``asyncio.timeout``, a cancellation that came from elsewhere (the client
    left) stays a ``CancelledError``: it is told apart by the task's
    cancellation count. One of these bounds every upstream attempt, and the
    relay arms one per streamed chunk, so it is kept to one timer handle and
    no state machine.
    """

    __slots__ = ("_cancelling", "_delay", "_handle", "_task", "expired")

    def __init__(self, delay: float) -> None:
        self._delay = delay
        self.expired = False

    def __enter__(self) -> Expiry:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Expiry is used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._handle = task.get_loop().call_later(max(0.0, self._delay), self._expire)
        return self

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        self._handle.cancel()
        if (
            self.expired
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc


@dataclass(slots=True)
class Committed:
    """An attempt that reached its first body byte: the relay takes it from here."""

    response: aiohttp.ClientResponse
    first_chunk: bytes
    sent_at: float
    first_byte_at: float

    @property
    def status(self) -> int:
        return self.response.status

    def close(self) -> None:
        """Drop the connection: the engine sees the client leave and aborts the work."""
        self.response.close()


def upstream_timeout(connect_s: float) -> aiohttp.ClientTimeout:
    """aiohttp's timeouts for an attempt: the connect only; ``attempt`` bounds the rest."""
    return aiohttp.ClientTimeout(total=None, sock_connect=connect_s, connect=None)


def make_session(connect_s: float) -> aiohttp.ClientSession:
    """The one client session the proxy shares across all replicas."""
    connector = aiohttp.TCPConnector(limit=CONNECTOR_LIMIT, limit_per_host=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=upstream_timeout(connect_s),
        auto_decompress=False,  # bytes pass through as the replica sent them
        cookie_jar=aiohttp.DummyCookieJar(),
        raise_for_status=False,
    )


async def attempt(
    session: aiohttp.ClientSession,
    replica: Replica,
    request: UpstreamRequest,
    deadline: Deadline,
    clock: Clock,
    *,
    extra_headers: dict[str, str],
    client_timeout: aiohttp.ClientTimeout | None = None,
) -> Committed:
    """Send ``request`` to ``replica`` and wait for the first body byte.

    ``client_timeout``: the connect timeout of the running config
    (``upstream_timeout``), so a reload applies to the next attempt; by
    default, the session's own.

    On any failure the response (if any) is closed before the error is raised,
    so a failed attempt never leaks a connection.

    A kept-alive connection the replica closed meanwhile fails before any
    answer; the request is then sent once more at once, on a new connection,
    inside the same attempt and timers (``resend_on_stale``, at most
    ``STALE_RESENDS`` times). llama.cpp's
    server does this after every streamed answer while advertising
    keep-alive, so every second request would otherwise fail (and count
    toward ejection); Go's net/http retries the same case the same way.
    """
    sent_at = clock.now()
    if request.streaming:
        wait_until = deadline.first_byte_at(sent_at)
        by_total = deadline.first_byte_is_total(sent_at)
    else:
        wait_until, by_total = deadline.total_at, True
    headers = CIMultiDict(request.headers)
    headers.update(extra_headers)
    headers["X-Request-Timeout-Ms"] = deadline.remaining_ms_header(sent_at)
    if request.streaming and replica.drops_kept_alive:
        # Its connection would be pooled, then found dead by the next request.
        headers["Connection"] = "close"
    response: aiohttp.ClientResponse | None = None
    try:
        with Expiry(wait_until - sent_at):
            resends = STALE_RESENDS if request.resend_on_stale else 0
            while True:
                try:
                    response = await _send(session, replica, request, headers, client_timeout)
                    break
                except STALE_CONNECTION as exc:
                    # A refused connection is a dead replica, not a stale one.
                    if not resends or isinstance(exc, aiohttp.ClientConnectorError):
                        raise
                    resends -= 1
                    replica.drops_kept_alive = True
            first_chunk = await response.content.readany()
    except aiohttp.ClientError as exc:
        # Before TimeoutError: aiohttp's connect timeout is a subclass of both.
        if response is not None:
            response.close()
        raise translate(exc, replica) from exc
    except TimeoutError as exc:
        if response is not None:
            response.close()
        waited_ms = (clock.now() - sent_at) * 1000.0
        if by_total:
            raise TotalTimeout(
                f"replica {replica.name} gave no answer within the request's total budget "
                f"({waited_ms:.0f} ms)"
            ) from exc
        raise FirstByteTimeout(
            f"replica {replica.name} sent no first byte within {waited_ms:.0f} ms"
        ) from exc
    except BaseException:
        if response is not None:
            response.close()
        raise
    return Committed(response, first_chunk, sent_at, clock.now())


#: A pooled connection the peer closed shows up as one of these before any answer.
#: Several may sit in the pool when several streams ended at once; each resend
#: that meets one discards it, and a refused connect ends the loop at once.
STALE_RESENDS = 2
STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


async def _send(
    session: aiohttp.ClientSession,
    replica: Replica,
    request: UpstreamRequest,
    headers: CIMultiDict[str],
    client_timeout: aiohttp.ClientTimeout | None = None,
) -> aiohttp.ClientResponse:
    # Already normalised at the entrance: ``encoded=True`` keeps yarl from
    # resolving dot segments (or re-quoting) after the replica's prefix is joined.
    return await session.request(
        request.method,
        URL(replica.url + request.path_qs, encoded=True),
        headers=headers,
        skip_auto_headers=None if "User-Agent" in headers else NO_USER_AGENT,
        data=request.body if request.body else None,
        allow_redirects=False,
        timeout=session.timeout if client_timeout is None else client_timeout,
        ssl=replica.ssl,
    )


def translate(exc: aiohttp.ClientError, replica: Replica) -> ProxyError:
    """aiohttp's client errors before the first byte, as outcomes."""
    where = f"replica {replica.name}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return ConnectTimeout(f"{where}: connect timed out")
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cause = exc.certificate_error
        detail = getattr(cause, "verify_message", None) or str(cause)
        return UpstreamConnectError(f"{where}: TLS certificate verification failed ({detail})")
    if isinstance(exc, aiohttp.ClientConnectorSSLError):
        return UpstreamConnectError(f"{where}: TLS handshake failed ({exc.os_error})")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamConnectError(f"{where}: cannot connect ({exc.os_error.strerror or exc})")
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return ConnectTimeout(f"{where}: timed out ({exc})")
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return ResetBeforeFirstByte(f"{where}: connection closed before the first byte")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return ResetBeforeFirstByte(f"{where}: broken response before the first byte")
    return UpstreamProtocolError(f"{where}: {type(exc).__name__}: {exc}")


async def read_chunk(
    upstream: aiohttp.ClientResponse, deadline: Deadline, clock: Clock, idle_s: float
) -> bytes:
    """The answer's next bytes after the commit point (b"" at its end), errors translated."""
    content = upstream.content
    if content.is_eof():  # the rest of a small answer is already here
        return content.read_nowait()
    remaining = deadline.remaining(clock.now())
    try:
        with Expiry(min(idle_s, remaining)):
            return await content.readany()
    except aiohttp.ClientError as exc:  # first: some of aiohttp's are TimeoutErrors too
        raise UpstreamProtocolError(f"upstream answer broke off: {type(exc).__name__}") from exc
    except TimeoutError as exc:
        if remaining <= idle_s:
            raise TotalTimeout("the request's total budget ran out mid-answer") from exc
        raise IdleTimeout(f"no upstream bytes for {idle_s * 1000:.0f} ms") from exc
