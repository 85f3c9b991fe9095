"""Structured logs: the process log and the one access line per request.

structlog renders JSON lines; the access line is written in exactly one place
(``access_line``), when a request ends, with the fields of DESIGN section 7.
API keys never reach a log: the record holds the tenant name, not the key.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from proxy.record import RequestRecord

ACCESS_LOGGER = "admission.access"


def configure_logging(level: str = "INFO") -> None:
    """JSON lines on stdout for everything logged through structlog."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )


def access_fields(record: RequestRecord, trace_id: str | None) -> dict[str, Any]:
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
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
    }


def access_line(record: RequestRecord, trace_id: str | None = None) -> None:
    structlog.get_logger(ACCESS_LOGGER).info("request", **access_fields(record, trace_id))
