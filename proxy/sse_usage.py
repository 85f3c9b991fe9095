"""Removing from a stream the usage the proxy asked for (``usage_request.py``).

With ``include_usage`` an OpenAI-style stream carries two things it would
not have carried otherwise: one last chunk with empty ``choices`` and the
``usage`` object, and (OpenAI, vLLM) a ``"usage":null`` field in every other
chunk. ``UsageStripper`` removes both and leaves every other byte as it was:
kept events are passed through untouched, in the same order, with the same
separators. Only complete events (ending in a blank line, ``\\n\\n`` or
``\\r\\n\\r\\n`` as the stream's first line end says: ``sse_frames.event_end``)
are passed on, so an event is never cut in two; a stream with bare ``\\r``
line ends is passed through as it is, and an event that grows past
``sse_frames.MAX_HELD_BYTES`` without ending is passed on as it comes, up to
its end (``sse_frames.LongEvent``). No I/O here.

Known difference: llama.cpp puts its ``timings`` object in the last chunk it
sends, which with ``include_usage`` is the usage chunk, so a llama.cpp
client loses that (non-OpenAI) field; the tokens and every OpenAI field are
as they would have been.
"""

from __future__ import annotations

import json
import re

from proxy.sse_frames import MAX_HELD_BYTES, LongEvent, event_end

#: ``"usage":null`` with the comma that joins it to its neighbour (after or before it).
_NULL_USAGE = re.compile(rb',\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,\s*')


def _added_usage_chunk(event: bytes) -> bool:
    """Is this event the usage-only chunk (``choices`` empty, ``usage`` an object)?"""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                doc = json.loads(line[5:])
            except ValueError:
                return False
            return (
                isinstance(doc, dict)
                and doc.get("choices") == []
                and isinstance(doc.get("usage"), dict)
            )
    return False


class UsageStripper:
    """Feeds on the replica's bytes; returns what the client would have received."""

    __slots__ = ("_end", "_long", "_passthrough", "_pending", "stripped")

    def __init__(self) -> None:
        self._pending = b""
        self._passthrough = False
        #: The stream's event end, once its first line end has been seen.
        self._end: bytes | None = None
        self._long: LongEvent | None = None
        #: Usage chunks removed (tests and the benchmark read it).
        self.stripped = 0

    def feed(self, chunk: bytes) -> bytes:
        if self._passthrough:
            return chunk
        if self._long is not None:
            at = self._long.split(chunk)
            if at < 0:
                return chunk
            self._long = None
            return chunk[:at] + self.feed(chunk[at:]) if at < len(chunk) else chunk
        data = self._pending + chunk if self._pending else chunk
        separator = self._end
        if separator is None:
            separator = self._end = event_end(data)
            if separator == b"":
                self._passthrough = True
                self._pending = b""
                return data
        end = data.rfind(separator) if separator is not None else -1
        if separator is None or end < 0:
            self._pending = data
            if len(data) > MAX_HELD_BYTES:
                if separator:
                    self._long = LongEvent(separator, data)
                else:  # not even a line has ended: no framing to come back to
                    self._passthrough = True
                return self.flush()
            return b""
        cut = end + len(separator)
        complete, self._pending = data[:cut], data[cut:]
        if b'"usage"' not in complete:
            return complete
        events = complete.split(separator)
        events.pop()  # the empty tail after the last separator
        kept = []
        for event in events:
            if b'"usage"' in event:
                if _NULL_USAGE.search(event) is not None:
                    event = _NULL_USAGE.sub(b"", event)
                elif _added_usage_chunk(event):
                    self.stripped += 1
                    continue
            kept.append(event + separator)
        return b"".join(kept)

    def flush(self) -> bytes:
        """What is left at the end of the stream (an unterminated last event), as it came."""
        rest, self._pending = self._pending, b""
        return rest

    def __repr__(self) -> str:
        return f"<UsageStripper {self.stripped} stripped, {len(self._pending)} bytes pending>"
