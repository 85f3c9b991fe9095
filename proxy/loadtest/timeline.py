"""What the phases run means: goodput, rejections, the timeline, the drain time.

Owns the pure summaries of a phases run: ``is_good`` (the goodput rule),
``summarise_phases`` (per phase, per tenant, per time bin) and
``drain_after`` (how long the queues took to empty after a phase). Input is
the run's request results, its metric samples and the workload; no I/O.

Goodput follows vLLM's benchmark: a request is good only if it succeeded and
met every SLO set for its tenant (TTFT, time per output token, total
latency). Every sent request is counted exactly once as good, ``slo_missed``
(succeeded too slowly), or under the reason it failed (the proxy's
``X-Admission-Reason``, else the generator's error name), so the columns of
a row add up to ``sent``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from proxy.loadtest.results import RequestResult, error_kind, percentile, percentile_ms
from proxy.loadtest.schedule import Arrival, PhaseWindow
from proxy.loadtest.scrape import MetricsSample
from proxy.loadtest.workload import Slo, Workload

__all__ = [
    "GOOD",
    "NOT_SENT",
    "SLO_MISSED",
    "Drain",
    "GroupSummary",
    "PhasesSummary",
    "TimelineBin",
    "classify",
    "drain_after",
    "is_good",
    "summarise_phases",
]

GOOD = "good"
SLO_MISSED = "slo_missed"
#: Arrivals the generator itself could not send: reported, never blamed on the target.
NOT_SENT = frozenset({"generator_overloaded"})


def is_good(result: RequestResult, slo: Slo) -> bool:
    """Succeeded and met every SLO that is set (a missing TTFT fails a TTFT SLO)."""
    if not result.ok:
        return False
    if slo.ttft_ms is not None and (result.ttft_s is None or result.ttft_s * 1000 > slo.ttft_ms):
        return False
    if slo.total_ms is not None and result.latency_s * 1000 > slo.total_ms:
        return False
    tpot = result.tpot_s
    return not (slo.tpot_ms is not None and tpot is not None and tpot * 1000 > slo.tpot_ms)


def classify(result: RequestResult, slo: Slo) -> str:
    """``good``, ``slo_missed``, or the reason the request failed."""
    if result.ok:
        return GOOD if is_good(result, slo) else SLO_MISSED
    return error_kind(result)


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """One row of the per-phase or per-tenant table."""

    name: str
    sent: int
    ok: int
    good: int
    outcomes: Mapping[str, int]
    duration_s: float
    asked_rate_per_s: float | None = None
    achieved_rate_per_s: float | None = None
    not_sent: int = 0
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    latency_p50_ms: float | None = None
    latency_p95_ms: float | None = None
    send_lag_p99_ms: float | None = None
    queue_depth_max: float | None = None
    retries: float | None = None

    @property
    def goodput_per_s(self) -> float:
        return self.good / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def goodput_ratio(self) -> float | None:
        return self.good / self.sent if self.sent else None

    @property
    def rejections(self) -> dict[str, int]:
        """Failures by reason: everything but good and slo_missed."""
        return {k: v for k, v in self.outcomes.items() if k not in (GOOD, SLO_MISSED)}

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["outcomes"] = dict(self.outcomes)
        data["rejections"] = self.rejections
        data["goodput_per_s"] = self.goodput_per_s
        data["goodput_ratio"] = self.goodput_ratio
        return data


@dataclass(frozen=True, slots=True)
class TimelineBin:
    """One time slice: offered load, what came back, and the queue, per second."""

    start_s: float
    end_s: float
    phase: str
    offered_per_s: float
    sent_per_s: float
    ok_per_s: float
    goodput_per_s: float
    rejected_per_s: float
    rejections: Mapping[str, int] = field(default_factory=dict)
    queue_depth: float | None = None
    inflight: float | None = None
    retries_per_s: float | None = None
    latency_p95_ms: float | None = None

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["rejections"] = dict(self.rejections)
        return data


@dataclass(frozen=True, slots=True)
class Drain:
    """How long after ``phase`` ended the queues took to empty.

    ``drain_s`` is None when they never emptied before the run ended, or when
    the target exports no queue depth (``depth_at_end`` None as well). Its
    resolution is the scrape interval.
    """

    phase: str
    end_s: float
    depth_at_end: float | None
    drain_s: float | None
    resolution_s: float

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PhasesSummary:
    total: GroupSummary
    phases: tuple[GroupSummary, ...]
    tenants: tuple[GroupSummary, ...]
    timeline: tuple[TimelineBin, ...]
    drain: Drain
    retries_by_reason: Mapping[str, float]
    retry_budget_exhausted: float | None


def drain_after(
    window: PhaseWindow, samples: Sequence[MetricsSample], resolution_s: float
) -> Drain:
    """Time from the end of ``window`` until a scrape first saw every queue empty."""
    ordered = sorted((s for s in samples if s.total_depth is not None), key=lambda s: s.t)
    end = window.end_s
    before = [s for s in ordered if s.t <= end]
    if not ordered:
        return Drain(window.name, end, None, None, resolution_s)
    at_end = before[-1] if before else ordered[0]
    depth = at_end.total_depth
    if depth is not None and depth <= 0:
        return Drain(window.name, end, depth, 0.0, resolution_s)
    for sample in ordered:
        if sample.t > end and (sample.total_depth or 0.0) <= 0:
            return Drain(window.name, end, depth, sample.t - end, resolution_s)
    return Drain(window.name, end, depth, None, resolution_s)


def _retry_delta(samples: Sequence[MetricsSample], start: float, end: float) -> float | None:
    inside = [s for s in samples if start <= s.t <= end]
    before = [s for s in samples if s.t < start]
    first = before[-1] if before else (inside[0] if inside else None)
    last = inside[-1] if inside else None
    if first is None or last is None or not (first.queue_depth or last.retries):
        return None  # not the proxy: nobody here counts retries
    return max(0.0, last.total_retries - first.total_retries)


def _group(
    name: str,
    results: Sequence[RequestResult],
    workload: Workload,
    duration_s: float,
    *,
    asked_rate: float | None = None,
    samples: Sequence[MetricsSample] = (),
    window: tuple[float, float] | None = None,
) -> GroupSummary:
    sent = [r for r in results if r.error not in NOT_SENT]
    outcomes = Counter(classify(r, workload.slo_for(r.tenant)) for r in sent)
    ok = [r for r in sent if r.ok]
    lags = [r.started_at - r.due_at for r in sent if r.due_at is not None]
    depth_max: float | None = None
    retries: float | None = None
    if window is not None:
        depths = [
            s.total_depth
            for s in samples
            if window[0] <= s.t <= window[1] and s.total_depth is not None
        ]
        depth_max = max(depths) if depths else None
        retries = _retry_delta(samples, *window)
    lag = percentile(lags, 99)
    return GroupSummary(
        name=name,
        sent=len(sent),
        ok=len(ok),
        good=outcomes.get(GOOD, 0),
        outcomes=dict(outcomes.most_common()),
        duration_s=duration_s,
        asked_rate_per_s=asked_rate,
        achieved_rate_per_s=len(sent) / duration_s if duration_s > 0 else None,
        not_sent=len(results) - len(sent),
        ttft_p50_ms=percentile_ms((r.ttft_s for r in ok), 50),
        ttft_p95_ms=percentile_ms((r.ttft_s for r in ok), 95),
        latency_p50_ms=percentile_ms((r.latency_s for r in ok), 50),
        latency_p95_ms=percentile_ms((r.latency_s for r in ok), 95),
        send_lag_p99_ms=None if lag is None else lag * 1000.0,
        queue_depth_max=depth_max,
        retries=retries,
    )


def _timeline(
    results: Sequence[RequestResult],
    arrivals: Sequence[Arrival],
    windows: Sequence[PhaseWindow],
    samples: Sequence[MetricsSample],
    workload: Workload,
    end_s: float,
) -> list[TimelineBin]:
    width = workload.timeline_bin_s
    count = max(1, math.ceil(end_s / width))
    offered = Counter(int(a.at_s // width) for a in arrivals)
    sent = Counter(int(r.started_at // width) for r in results if r.error not in NOT_SENT)
    ended: dict[int, list[RequestResult]] = {}
    for r in results:
        if r.error not in NOT_SENT:
            ended.setdefault(min(int(r.ended_at // width), count - 1), []).append(r)
    bins = []
    for i in range(count):
        start, stop = i * width, (i + 1) * width
        span = stop - start
        done = ended.get(i, [])
        kinds = Counter(classify(r, workload.slo_for(r.tenant)) for r in done)
        rejected = {k: v for k, v in kinds.items() if k not in (GOOD, SLO_MISSED)}
        inside = [s for s in samples if start <= s.t < stop]
        depths = [s.total_depth for s in inside if s.total_depth is not None]
        inflight = [s.replica_inflight for s in inside if s.replica_inflight is not None]
        phase = next((w.name for w in windows if w.start_s <= start < w.end_s), "drain")
        retries = _retry_delta(samples, start, stop)
        bins.append(
            TimelineBin(
                start_s=start,
                end_s=stop,
                phase=phase,
                offered_per_s=offered.get(i, 0) / span,
                sent_per_s=sent.get(i, 0) / span,
                ok_per_s=sum(1 for r in done if r.ok) / span,
                goodput_per_s=kinds.get(GOOD, 0) / span,
                rejected_per_s=sum(rejected.values()) / span,
                rejections=dict(sorted(rejected.items())),
                queue_depth=max(depths) if depths else None,
                inflight=max(inflight) if inflight else None,
                retries_per_s=None if retries is None else retries / span,
                latency_p95_ms=percentile_ms((r.latency_s for r in done if r.ok), 95),
            )
        )
    return bins


def summarise_phases(
    results: Sequence[RequestResult],
    arrivals: Sequence[Arrival],
    windows: Sequence[PhaseWindow],
    samples: Sequence[MetricsSample],
    workload: Workload,
    *,
    end_s: float,
) -> PhasesSummary:
    """Every table and series of the phases report, from one run's raw material."""
    ordered = sorted(samples, key=lambda s: s.t)
    load_s = windows[-1].end_s if windows else 0.0
    phases = tuple(
        _group(
            w.name,
            [r for r in results if r.phase == w.name],
            workload,
            w.phase.duration_s,
            asked_rate=w.phase.mean_rate_per_s,
            samples=ordered,
            window=(w.start_s, w.end_s),
        )
        for w in windows
    )
    tenants = tuple(
        _group(name, [r for r in results if r.tenant == name], workload, load_s)
        for name in workload.tenants
    )
    asked = sum(w.phase.mean_rate_per_s * w.phase.duration_s for w in windows)
    total = _group(
        "total",
        results,
        workload,
        load_s,
        asked_rate=asked / load_s if load_s else None,
        samples=ordered,
        window=(0.0, end_s),
    )
    drain_window = next(w for w in windows if w.name == workload.drain_phase().name)
    first, last = (ordered[0], ordered[-1]) if ordered else (None, None)
    by_reason: dict[str, float] = {}
    exhausted: float | None = None
    if first is not None and last is not None:
        for reason, value in last.retries.items():
            by_reason[reason] = max(0.0, value - first.retries.get(reason, 0.0))
        if last.retry_budget_exhausted is not None:
            exhausted = last.retry_budget_exhausted - (first.retry_budget_exhausted or 0.0)
    return PhasesSummary(
        total=total,
        phases=phases,
        tenants=tenants,
        timeline=tuple(_timeline(results, arrivals, windows, ordered, workload, end_s)),
        drain=drain_after(drain_window, ordered, workload.metrics_interval_s),
        retries_by_reason={k: v for k, v in sorted(by_reason.items()) if v > 0},
        retry_budget_exhausted=exhausted,
    )
