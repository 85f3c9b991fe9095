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
    cancellation count. One of these bounds every upstream attempt, so it is
    kept to one timer handle and no state machine (the relay's reads after
    the commit point have ``AnswerReader``, one timer for the whole answer).
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
    # A response aiohttp could not parse: its message, not its ``str``, which
    # names the replica's URL (an address the client is never told).
    detail = exc.message if isinstance(exc, aiohttp.ClientResponseError) else exc
    return UpstreamProtocolError(f"{where}: {type(exc).__name__}: {detail}")


class AnswerReader:
    """The answer's reads after the commit point, each bounded by the idle timeout
    and the total deadline, with one timer per answer instead of one per read.

    A read that waits longer than ``idle_s`` for bytes ends in ``IdleTimeout``;
    one whose wait the total deadline cuts shorter, in ``TotalTimeout``
    (which of the two is decided when the read starts, as ``Expiry`` would
    arm it). Time spent between reads (writing to a slow client) counts for
    the total deadline only: a replica is never idle because the client is
    slow, but an answer the client takes too slowly (or stops taking) still
    ends at the total deadline, the task cancelled where it waits on the
    client; ``ran_out`` tells that cancellation apart. The relay reads once
    per streamed token, so arming and cancelling a timer per read
    (``Expiry``) cost more than the rest of the relay's own work; here a
    read only notes when it expires, and the one timer, when it fires early
    (armed for an earlier read), is re-armed for the read now waiting, or
    for the total deadline when none is (the next read arms it earlier).
    A timer never fires later than the read it guards expires: each read
    expires no earlier than the one before it.

        reader = AnswerReader(response, deadline, clock, idle_s)
        try:
            while chunk := await reader.read(): ...
        except asyncio.CancelledError:
            if not reader.ran_out(): raise
            ...  # the total deadline, while writing to the client
        finally:
            reader.close()
    """

    __slots__ = (
        "_armed", "_cancelling", "_clock", "_content", "_expired", "_handle", "_idle_s", "_loop",
        "_reading", "_task", "_total_at", "_until",
    )  # fmt: skip

    def __init__(
        self, upstream: aiohttp.ClientResponse, deadline: Deadline, clock: Clock, idle_s: float
    ) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("AnswerReader is used inside a task")
        self._task = task
        self._loop = task.get_loop()
        self._content = upstream.content
        self._clock = clock
        self._idle_s = idle_s
        self._total_at = deadline.total_at
        self._handle: asyncio.TimerHandle | None = None
        #: When the armed timer fires, and when the read now waiting expires.
        self._armed = self._until = 0.0
        self._reading = False
        self._expired = False
        self._cancelling = task.cancelling()
        # Before any read, writing the first bytes is bounded by the total too.
        self._arm(self._total_at, clock.now())

    def __repr__(self) -> str:
        state = "expired" if self._expired else "reading" if self._reading else "idle"
        return f"<AnswerReader {state}, timer {'armed' if self._handle else 'off'}>"

    async def read(self) -> bytes:
        """The answer's next bytes (b"" at its end), errors translated."""
        content = self._content
        if content.is_eof():  # the rest of a small answer is already here
            return content.read_nowait()
        started = self._clock.now()
        by_total = self._total_at - started <= self._idle_s
        self._until = self._total_at if by_total else started + self._idle_s
        if self._handle is None or self._armed > self._until:
            self._arm(self._until, started)
        task = self._task
        cancelling = task.cancelling()
        self._reading = True
        try:
            try:
                return await content.readany()
            except BaseException as exc:
                # As ``Expiry``: only the cancellation this reader asked for
                # becomes a timeout; one from elsewhere (the client left) stays.
                # It is taken back once, here: ``ran_out`` must not take back the
                # client's too when both came in the same loop iteration.
                if self._expired and isinstance(exc, asyncio.CancelledError):
                    self._expired = False
                    if task.uncancel() <= cancelling:
                        raise TimeoutError from exc
                raise
            finally:
                self._reading = False
        except aiohttp.ClientError as exc:  # first: some of aiohttp's are TimeoutErrors too
            raise UpstreamProtocolError(f"upstream answer broke off: {type(exc).__name__}") from exc
        except TimeoutError as exc:
            if by_total:
                raise TotalTimeout("the request's total budget ran out mid-answer") from exc
            raise IdleTimeout(f"no upstream bytes for {self._idle_s * 1000:.0f} ms") from exc

    def _arm(self, at: float, now: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed = at
        self._handle = self._loop.call_later(max(0.0, at - now), self._fire)

    def _fire(self) -> None:
        self._handle = None
        # Between reads (writing to the client) only the total deadline counts.
        if self._armed >= (self._until if self._reading else self._total_at):
            self._expired = True
            self._task.cancel()
        elif self._reading:  # armed for an earlier read: the one waiting now expires later
            self._arm(self._until, self._clock.now())
        else:
            self._arm(self._total_at, self._clock.now())

    def ran_out(self) -> bool:
        """After a ``CancelledError`` outside ``read``: True when it was this reader's
        total deadline (the cancellation is then taken back), False when it came from
        elsewhere (the client left) and must go on."""
        return self._expired and self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
