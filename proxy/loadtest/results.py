"""What one load-test request did, and the percentile arithmetic every summary uses.

Owns ``RequestSpec`` (what to send), ``RequestResult`` (what came back, with
client-side timings) and ``percentile``. No I/O here: the generator fills
results in, the summaries read them.

Times are seconds on the run's own monotonic clock, counted from the run's
start, so results from one run line up on one axis (the phases timeline).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "RequestResult",
    "RequestSpec",
    "error_kind",
    "percentile",
    "percentile_ms",
]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: a ready JSON body and its headers, plus labels for reports."""

    path: str
    body: bytes
    headers: Mapping[str, str]
    input_tokens: int
    max_tokens: int
    stream: bool = True
    tenant: str = ""
    request_class: str = ""
    phase: str = ""


@dataclass(slots=True)
class RequestResult:
    """The client's view of one request.

    ``error`` is None exactly when the request succeeded: a 2xx whose body (or
    stream, through ``[DONE]``) arrived whole. Otherwise it names what went
    wrong in a stable, countable form: ``http_503``, ``connect_error``,
    ``client_timeout``, ``stream_error:idle_timeout``, ``stream_broken``.
    ``reason`` is the proxy's ``X-Admission-Reason`` when it sent one.
    """

    index: int
    started_at: float
    ended_at: float = math.nan
    status: int | None = None
    error: str | None = None
    reason: str | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    input_tokens: int = 0
    queue_ms: float | None = None
    queue_source: str | None = None
    tenant: str = ""
    request_class: str = ""
    phase: str = ""
    due_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency_s(self) -> float:
        return self.ended_at - self.started_at

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None below two tokens."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def error_kind(result: RequestResult) -> str:
    """The label a failed request is counted under: the proxy's reason, else the error.

    The proxy's reason code (``queue_timeout``, ``tenant_queue_full``) is what
    an operator acts on; a bare upstream status or a client-side failure is
    counted by the generator's own error name.
    """
    if result.reason and result.reason != "upstream_status":
        return result.reason
    return result.error or "ok"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values.

    The same definition as numpy's default, so figures match what an operator
    computes from ``requests.csv`` by hand.
    """
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_ms(values_s: Iterable[float | None], q: float) -> float | None:
    """``percentile`` of seconds, in milliseconds, ignoring missing values."""
    present = [value for value in values_s if value is not None]
    value = percentile(present, q)
    return None if value is None else value * 1000.0
