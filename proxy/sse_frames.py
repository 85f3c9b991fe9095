"""Passing a relayed SSE stream on in whole events.

A replica's bytes reach the proxy cut wherever TCP cut them, so a chunk can
end inside an event. Relayed as they came, the client holds half an event
when the answer fails mid-stream (the replica dies, an idle timeout), and the
proxy's error event is glued to it: the client's SSE parser then reads one
broken event and never the error (the OpenAI SDK raises a JSON error instead
of the proxy's message). ``SseFramer`` holds back the unfinished tail of each
chunk until its blank line arrives, so the client only ever holds whole events
and the error event stands on its own.

Holding the tail back costs the client nothing: an SSE client dispatches an
event only at its blank line. Engines write one whole event per chunk, which
passes at once without a copy. A stream framed with ``\\r\\n`` (sse-starlette,
which llama-cpp-python and many FastAPI servers use) is cut at ``\\r\\n\\r\\n``;
its framing is read from the first line end it sends. A stream with bare
``\\r`` line ends, or one that mixes ``\\r`` into ``\\n`` framing, is passed as
it is. An event that grows past ``MAX_HELD_BYTES`` without ending is passed
on as it comes, up to its end (``LongEvent``), and the events after it are
whole again, so holding is bounded. No I/O here.
"""

from __future__ import annotations

#: An unfinished event longer than this is passed on as it comes.
MAX_HELD_BYTES = 1 << 20
#: The blank line that ends an event, as ``\n`` and as ``\r\n`` streams write it.
LF_END = b"\n\n"
CRLF_END = b"\r\n\r\n"


def event_end(data: bytes) -> bytes | None:
    """The blank line that ends the events of a stream whose first bytes are ``data``,
    read from its first line end: None while it has none yet (or it is a ``\\r`` whose
    next byte has not come), b"" for a framing not cut here (bare ``\\r``)."""
    lf, cr = data.find(b"\n"), data.find(b"\r")
    if cr < 0:
        return LF_END if lf >= 0 else None
    if 0 <= lf < cr:
        return LF_END
    if cr + 1 == len(data):
        return None
    return CRLF_END if lf == cr + 1 else b""


class LongEvent:
    """The rest of an event that outgrew ``MAX_HELD_BYTES``, passed on as it comes:
    ``split`` finds where it ends, across reads (``tail``: the bytes already passed
    that an event end cut by a read may begin in)."""

    __slots__ = ("end", "tail")

    def __init__(self, end: bytes, passed: bytes) -> None:
        self.end = end
        self.tail = passed[1 - len(end) :]

    def split(self, chunk: bytes) -> int:
        """Where in ``chunk`` the event has ended (after its blank line); -1: not yet."""
        probe = self.tail + chunk
        at = probe.find(self.end)
        if at < 0:
            self.tail = probe[1 - len(self.end) :]
            return -1
        return at + len(self.end) - len(self.tail)


class SseFramer:
    """Feeds on the replica's bytes; returns the whole events among them."""

    __slots__ = ("_end", "_held", "_long", "_passthrough")

    def __init__(self) -> None:
        self._held = b""
        self._passthrough = False
        #: The stream's event end, once its first line end has been seen.
        self._end: bytes | None = None
        self._long: LongEvent | None = None

    def feed(self, chunk: bytes) -> bytes:
        if self._passthrough:
            return chunk
        if self._long is not None:
            at = self._long.split(chunk)
            if at < 0:
                return chunk
            self._long = None
            return chunk[:at] + self.feed(chunk[at:]) if at < len(chunk) else chunk
        end_of_event = self._end
        if end_of_event is LF_END:
            if not self._held and chunk.endswith(LF_END):
                return chunk  # the common case: whole events
            if b"\r" in chunk:
                self._passthrough = True
                return self.flush() + chunk
        elif end_of_event is None:
            end_of_event = self._end = event_end(self._held + chunk)
            if end_of_event == b"":
                self._passthrough = True
                return self.flush() + chunk
        data = self._held + chunk if self._held else chunk
        end = data.rfind(end_of_event) if end_of_event is not None else -1
        if end_of_event is None or end < 0:
            return self._hold(data)
        cut = end + len(end_of_event)
        self._held = data[cut:]
        return data[:cut]

    def _hold(self, data: bytes) -> bytes:
        """No event ends in ``data`` yet: held, unless it has grown past the bound."""
        self._held = data
        if len(data) > MAX_HELD_BYTES:
            if self._end:
                self._long = LongEvent(self._end, data)
            else:  # not even a line has ended: no framing to come back to
                self._passthrough = True
            return self.flush()
        return b""

    def flush(self) -> bytes:
        """What is held: the stream ended normally, and its last bytes go out as they are."""
        held, self._held = self._held, b""
        return held
