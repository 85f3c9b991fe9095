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
passes at once without a copy. A stream framed with ``\\r\\n`` is passed as
it is (as ``sse_usage.UsageStripper`` does), and so is an event that grows
past ``MAX_HELD_BYTES`` without ending, so holding is bounded. No I/O here.
"""

from __future__ import annotations

#: An unfinished event longer than this is passed on as it comes.
MAX_HELD_BYTES = 1 << 20
_SEPARATOR = b"\n\n"


class SseFramer:
    """Feeds on the replica's bytes; returns the whole events among them."""

    __slots__ = ("_held", "_passthrough")

    def __init__(self) -> None:
        self._held = b""
        self._passthrough = False

    def feed(self, chunk: bytes) -> bytes:
        if self._passthrough:
            return chunk
        if not self._held and chunk.endswith(_SEPARATOR):
            return chunk  # the common case: whole events
        if b"\r" in chunk:
            self._passthrough = True
            return self.flush() + chunk
        data = self._held + chunk if self._held else chunk
        end = data.rfind(_SEPARATOR)
        if end < 0:
            self._held = data
            if len(data) > MAX_HELD_BYTES:
                self._passthrough = True
                return self.flush()
            return b""
        self._held = data[end + 2 :]
        return data[: end + 2]

    def flush(self) -> bytes:
        """What is held: the stream ended normally, and its last bytes go out as they are."""
        held, self._held = self._held, b""
        return held
