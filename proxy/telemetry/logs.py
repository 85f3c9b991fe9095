"""Structured logs: the process log and the one access line per request.

structlog renders the process log as JSON lines; the access line, in the same
shape, is written in exactly one place (``AccessLog.write``), when a request
ends, with the fields of docs/REFERENCE.md.
API keys never reach a log: the record holds the tenant name, not the key.

Process lines go to stdout through ``LineLogger``, which writes without
flushing at info level and flushes at once from warning up; access lines are
held by ``AccessLog`` and written in batches. Both are flushed on a short
interval and at shutdown, so a line is out within a fraction of a second
without a write syscall per request.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any, TextIO

import structlog

from proxy.record import RequestRecord

#: How often buffered log lines are flushed.
FLUSH_INTERVAL_S = 0.2
#: Access lines held for stdout before a batch is written between two flushes.
MAX_PENDING_LINES = 256


class LineLogger:
    """A structlog logger writing lines to a stream, flushing only what is urgent."""

    __slots__ = ("_stream",)

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _write(self, message: str) -> None:
        self._stream.write(message + "\n")

    def _urgent(self, message: str) -> None:
        self._stream.write(message + "\n")
        self._stream.flush()

    debug = info = msg = _write
    warning = warn = error = err = critical = exception = fatal = failure = _urgent

    def flush(self) -> None:
        self._stream.flush()


_writer = LineLogger(sys.stdout)


def flush_logs() -> None:
    _writer.flush()


def configure_logging(level: str = "INFO") -> None:
    """JSON lines on stdout for everything logged through structlog."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=lambda *_args: _writer,
        cache_logger_on_first_use=True,
    )


def access_fields(record: RequestRecord, trace_id: str | None) -> dict[str, Any]:
    """The access line's fields, in order (docs/REFERENCE.md), for an ended record."""
    return {
        "request_id": record.request_id,
        "trace_id": trace_id,
        "tenant": record.tenant,
        "priority": record.priority,
        "method": record.method,
        "path": record.path,
        "status": record.status,
        "outcome": record.outcome,
        "reason": record.reason,
        "entrance_ms": record.entrance_ms,
        "queue_ms": record.queue_ms,
        "ttft_ms": record.ttft_ms,
        "upstream_ms": record.upstream_ms,
        "total_ms": record.total_ms,
        "attempts": record.attempts,
        "replica": record.replica,
        "model": record.model,
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "quota_charged_tokens": record.quota_charged_tokens,
        "quota_actual_tokens": record.quota_actual_tokens,
        "degraded": record.degraded,
        "observed": record.observed,
    }


_quote = json.encoder.encode_basestring_ascii  # json.dumps's own string encoder (C)


def _text(value: str | None) -> str:
    return "null" if value is None else _quote(value)


def _number(value: float | None) -> str:
    return "null" if value is None else repr(value)


class AccessLog:
    """One JSON line per request, when it ends, in the same shape as the structlog lines.

    Written here instead of through structlog's processor chain: the access
    line is on every request's path, and the chain plus its logger were a
    large part of the proxy's CPU per request (docs/BENCHMARKS.md, overhead).
    The line is formatted field by field, byte for byte what
    ``json.dumps({"event": ..., **access_fields(record, trace_id)})`` gives
    (same string escaping, same number repr), at less cost.

    Lines for stdout (the default) are held and written in one call by
    ``flush``, which runs on a short interval and at shutdown, or as soon as
    ``MAX_PENDING_LINES`` wait: whatever buffering stdout has. With
    ``PYTHONUNBUFFERED=1`` (the Dockerfile sets it) stdout writes through,
    and every line was a write system call of its own. A stream passed in
    (tests, embedding) gets each line at once.
    """

    __slots__ = ("_pending", "_second", "_second_text", "_stream")

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self._pending: list[str] | None = [] if stream is None else None
        self._second = -1
        self._second_text = ""

    def _timestamp(self) -> str:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._second_text = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        return f"{self._second_text}.{int((now - second) * 1e6):06d}Z"

    def write(self, record: RequestRecord, trace_id: str | None = None) -> None:
        r = record
        line = (
            f'{{"event": "request", "level": "info", "timestamp": "{self._timestamp()}", '
            f'"request_id": {_quote(r.request_id)}, "trace_id": {_text(trace_id)}, '
            f'"tenant": {_quote(r.tenant)}, "priority": {_quote(r.priority)}, '
            f'"method": {_quote(r.method)}, "path": {_quote(r.path)}, '
            f'"status": {r.status!r}, "outcome": {_text(r.outcome)}, '
            f'"reason": {_quote(r.reason)}, "entrance_ms": {_number(r.entrance_ms)}, '
            f'"queue_ms": {_number(r.queue_ms)}, "ttft_ms": {_number(r.ttft_ms)}, '
            f'"upstream_ms": {_number(r.upstream_ms)}, "total_ms": {_number(r.total_ms)}, '
            f'"attempts": {r.attempts!r}, "replica": {_text(r.replica)}, '
            f'"model": {_text(r.model)}, '
            f'"input_tokens": {_number(r.input_tokens)}, '
            f'"output_tokens": {_number(r.output_tokens)}, '
            f'"quota_charged_tokens": {_number(r.quota_charged_tokens)}, '
            f'"quota_actual_tokens": {_number(r.quota_actual_tokens)}, '
            f'"degraded": {_text(r.degraded)}, "observed": {_text(r.observed)}}}\n'
        )
        pending = self._pending
        if pending is None:
            self._stream.write(line)
            return
        pending.append(line)
        if len(pending) >= MAX_PENDING_LINES:
            self._write_pending(pending)

    def _write_pending(self, pending: list[str]) -> None:
        self._stream.write("".join(pending))
        pending.clear()

    def flush(self) -> None:
        if self._pending:
            self._write_pending(self._pending)
        self._stream.flush()
