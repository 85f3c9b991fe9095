"""Figures of the fairness benchmark: per-flow statistics, ratios, verdicts and tables.

Pure functions of the ``Result``s that ``bench.fairness`` collected; no I/O.

Conventions, stated once here and in the printed report:

- a flow's figures cover the requests *due* in the measured window (the
  warm-up before it is sent but not counted);
- TTFT percentiles are nearest-rank, over the requests that were served in
  full; the protected flow's headline p99 is taken over *every* request it
  sent, an unserved one counting as infinitely late, so refusing the victim
  can never improve its p99;
- SLO attainment is the share of the requests sent that were served in full
  within both the TTFT and the total SLO;
- served throughput counts requests by the time of their first token, so a
  request that waited through the warm-up still counts when it was served.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from bench.common import FigureBase
from bench.fairness_accesslog import Wait
from bench.fairness_traffic import Flow, Result
from bench.load import percentile

BOOTSTRAP_RESAMPLES = 1000
#: A request whose proxy queue wait reached this counts as having waited.
WAITED_MS = 1.0
BOOTSTRAP_SEED = 0
#: The interval printed beside each p99 ratio: 5th to 95th bootstrap percentile.
INTERVAL = (0.05, 0.95)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float
    total_ms: float

    def met(self, r: Result) -> bool:
        return (
            r.ok
            and r.ttft_s is not None
            and r.total_s is not None
            and r.ttft_s * 1000.0 <= self.ttft_ms
            and r.total_s * 1000.0 <= self.total_ms
        )


@dataclass(slots=True)
class FlowStats:
    flow: str
    tenant: str
    offered_rps: float
    sent: int
    ok: int
    refused: dict[str, int]
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    #: Over every request sent; None when the 99th percentile was not served at all.
    ttft_p99_all_ms: float | None
    total_p99_ms: float | None
    queue_p50_ms: float | None
    queue_p99_ms: float | None
    slo_attainment: float | None
    served_rps: float
    served_tokens_per_s: float
    late_p99_ms: float | None


def due_in(results: Sequence[Result], start: float, end: float) -> list[Result]:
    return [r for r in results if start <= r.due_s < end]


def _ms(value: float) -> float:
    return round(value * 1000.0, 2)


def _pct_ms(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile in ms of unsorted seconds; None when empty or unserved."""
    if not values:
        return None
    value = percentile(sorted(values), q)
    return None if math.isinf(value) else _ms(value)


def ttft_all(results: Sequence[Result]) -> list[float]:
    """TTFT in seconds of every request, an unserved one as infinity."""
    return [r.ttft_s if r.ok and r.ttft_s is not None else math.inf for r in results]


def flow_stats(
    flow: Flow, results: Sequence[Result], slo: Slo, window: tuple[float, float]
) -> FlowStats:
    """``results`` are all of the flow's requests; the figures cover ``window``."""
    start, end = window
    measured = due_in(results, start, end)
    served = [r for r in measured if r.ok]
    refused = Counter(r.reason for r in measured if not r.ok)
    ttfts = [r.ttft_s for r in served if r.ttft_s is not None]
    queues = [r.queue_ms / 1000.0 for r in served if r.queue_ms is not None]
    in_window = [
        r
        for r in results
        if r.ok and r.first_token_s is not None and start <= r.first_token_s < end
    ]
    span = end - start
    return FlowStats(
        flow=flow.name,
        tenant=flow.tenant,
        offered_rps=round(flow.rate_per_s, 2),
        sent=len(measured),
        ok=len(served),
        refused=dict(refused.most_common()),
        ttft_p50_ms=_pct_ms(ttfts, 0.50),
        ttft_p99_ms=_pct_ms(ttfts, 0.99),
        ttft_p99_all_ms=_pct_ms(ttft_all(measured), 0.99),
        total_p99_ms=_pct_ms([r.total_s for r in served if r.total_s is not None], 0.99),
        queue_p50_ms=_pct_ms(queues, 0.50),
        queue_p99_ms=_pct_ms(queues, 0.99),
        slo_attainment=sum(slo.met(r) for r in measured) / len(measured) if measured else None,
        served_rps=round(len(in_window) / span, 2),
        served_tokens_per_s=round(sum(r.cost for r in in_window) / span, 1),
        late_p99_ms=_pct_ms([r.late_ms / 1000.0 for r in measured], 0.99),
    )


def p99_ratio(
    numerator: Sequence[Result], denominator: Sequence[Result]
) -> tuple[float, float, float]:
    """p99 TTFT (over every request sent) of one sample over another's, with an interval."""
    return value_p99_ratio(ttft_all(numerator), ttft_all(denominator))


def value_p99_ratio(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """p99 of ``a`` over p99 of ``b``, and a bootstrap interval around it.

    The interval resamples each side with replacement; it shows how much of
    a ratio is the luck of a few hundred requests' tail.
    """
    if not a or not b:
        return math.nan, math.nan, math.nan

    def ratio(x: Sequence[float], y: Sequence[float]) -> float:
        top, bottom = percentile(sorted(x), 0.99), percentile(sorted(y), 0.99)
        return top / bottom if bottom > 0 else math.inf

    rng = random.Random(BOOTSTRAP_SEED)
    draws = sorted(
        ratio(rng.choices(a, k=len(a)), rng.choices(b, k=len(b)))
        for _ in range(BOOTSTRAP_RESAMPLES)
    )
    low = draws[int(INTERVAL[0] * (len(draws) - 1))]
    high = draws[int(INTERVAL[1] * (len(draws) - 1))]
    return ratio(a, b), low, high


@dataclass(slots=True)
class Figure(FigureBase):
    """With its unit and bootstrap interval."""

    unit: str = "x"
    interval: tuple[float, float] | None = None

    def cells(self) -> list[str]:
        value = _fmt_value(self.value, self.unit)
        interval = ""
        if self.interval is not None:
            low, high = (_fmt_value(v, self.unit) for v in self.interval)
            interval = f"{low} to {high}"
        verdict = "" if self.passed is None else ("PASS" if self.passed else "MISS")
        return [self.name, value, interval, self.target, verdict]


def _fmt_value(value: float, unit: str) -> str:
    if math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "inf"
    if unit == "%":
        return f"{value * 100:.1f}%"
    return f"{value:.2f}{unit}"


def _fmt_ms(value: float | None) -> str:
    return "unserved" if value is None else f"{value:.0f}"


def flow_table(rows: Sequence[tuple[str, FlowStats]]) -> list[str]:
    lines = [
        "| scenario | flow (tenant) | offered req/s | sent | ok | not served (by reason) "
        "| TTFT p50 ms | TTFT p99 ms | TTFT p99 over all sent ms | total p99 ms "
        "| proxy queue p99 ms | SLO met | served req/s |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scenario, s in rows:
        refused = ", ".join(f"{reason} {n}" for reason, n in s.refused.items()) or "-"
        queue = "-" if s.queue_p99_ms is None else f"{s.queue_p99_ms:.0f}"
        attained = "-" if s.slo_attainment is None else f"{s.slo_attainment * 100:.1f}%"
        lines.append(
            f"| {scenario} | {s.flow} ({s.tenant}) | {s.offered_rps:.1f} | {s.sent} | {s.ok} "
            f"| {refused} | {_fmt_ms(s.ttft_p50_ms)} | {_fmt_ms(s.ttft_p99_ms)} "
            f"| {_fmt_ms(s.ttft_p99_all_ms)} | {_fmt_ms(s.total_p99_ms)} | {queue} | {attained} "
            f"| {s.served_rps:.1f} |"
        )
    return lines


def figure_table(figures: Sequence[Figure]) -> list[str]:
    lines = [
        "| figure | value | 90% bootstrap interval | target | verdict |",
        "|---|---:|---|---|---|",
    ]
    lines += ["| " + " | ".join(f.cells()) + " |" for f in figures]
    return lines


@dataclass(slots=True)
class WaitSplit:
    """A protected flow's queue wait, split with the proxy's access log."""

    flow: str
    served: int
    queued: int
    queue_p50_ms: float | None
    queue_p99_ms: float | None
    first_seat_p50_ms: float | None
    first_seat_p99_ms: float | None
    passed_over_p50: float | None
    passed_over_p99: float | None
    passed_over_max: int
    ttft_p99_ms: float | None
    #: Its p99 TTFT had every request waited only for the first seat to free.
    ideal_ttft_p99_ms: float | None


def ideal_ttfts(results: Sequence[Result], split: dict[str, Wait]) -> list[float]:
    """TTFT in seconds of each request had it been first in line (its wait: the first seat)."""
    values: list[float] = []
    for r in results:
        if not r.ok or r.ttft_s is None:
            values.append(math.inf)
            continue
        wait = split.get(r.request_id)
        if wait is None:
            values.append(r.ttft_s)
        else:
            values.append(max(0.0, r.ttft_s - (wait.queue_ms - wait.first_seat_ms) / 1000.0))
    return values


def wait_split(flow: str, measured: Sequence[Result], split: dict[str, Wait]) -> WaitSplit:
    served = [r for r in measured if r.ok]
    mine = [split[r.request_id] for r in served if r.request_id in split]
    queued = [w for w in mine if w.queue_ms >= WAITED_MS]
    passed = [float(w.passed_over) for w in mine]
    return WaitSplit(
        flow=flow,
        served=len(served),
        queued=len(queued),
        queue_p50_ms=_pct_ms([w.queue_ms / 1000.0 for w in mine], 0.50),
        queue_p99_ms=_pct_ms([w.queue_ms / 1000.0 for w in mine], 0.99),
        first_seat_p50_ms=_pct_ms([w.first_seat_ms / 1000.0 for w in mine], 0.50),
        first_seat_p99_ms=_pct_ms([w.first_seat_ms / 1000.0 for w in mine], 0.99),
        passed_over_p50=percentile(sorted(passed), 0.50) if passed else None,
        passed_over_p99=percentile(sorted(passed), 0.99) if passed else None,
        passed_over_max=int(max(passed, default=0)),
        ttft_p99_ms=_pct_ms(ttft_all(measured), 0.99),
        ideal_ttft_p99_ms=_pct_ms(ideal_ttfts(measured, split), 0.99),
    )


def wait_table(rows: Sequence[tuple[str, WaitSplit]]) -> list[str]:
    lines = [
        "| scenario | flow | served (waited in queue) | proxy queue p50 / p99 ms "
        "| first seat free p50 / p99 ms | tickets of others dispatched first p50 / p99 / max "
        "| TTFT p99 ms | TTFT p99 ms if always first in line (est.) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def pair(a: float | None, b: float | None) -> str:
        return f"{_fmt_ms(a)} / {_fmt_ms(b)}"

    for scenario, w in rows:
        passed = (
            "-"
            if w.passed_over_p50 is None or w.passed_over_p99 is None
            else f"{w.passed_over_p50:.0f} / {w.passed_over_p99:.0f} / {w.passed_over_max}"
        )
        lines.append(
            f"| {scenario} | {w.flow} | {w.served} ({w.queued}) "
            f"| {pair(w.queue_p50_ms, w.queue_p99_ms)} "
            f"| {pair(w.first_seat_p50_ms, w.first_seat_p99_ms)} | {passed} "
            f"| {_fmt_ms(w.ttft_p99_ms)} | {_fmt_ms(w.ideal_ttft_p99_ms)} |"
        )
    return lines


@dataclass(frozen=True, slots=True)
class CapsCost:
    """One scenario's served throughput in the plain and the second config: (plain, second)."""

    scenario: str
    served_rps: tuple[float, float]
    served_tokens_per_s: tuple[float, float]
    #: The part of it served to the flow that offers more than the fleet can serve.
    flood: str
    flood_rps: tuple[float, float]
    #: The others' part (the victim, interactive).
    others_rps: tuple[float, float]
    capacity_rps: float


def caps_cost(
    scenario: str,
    uncapped: Sequence[FlowStats],
    capped: Sequence[FlowStats],
    flood: str,
    capacity_rps: float,
) -> CapsCost:
    """Totals over every flow of a scenario, the same scenario in both configs."""

    def total(stats: Sequence[FlowStats]) -> tuple[float, float, float]:
        rps = sum(s.served_rps for s in stats)
        tokens = sum(s.served_tokens_per_s for s in stats)
        flood_rps = sum(s.served_rps for s in stats if s.flow == flood)
        return round(rps, 2), round(tokens, 1), round(flood_rps, 2)

    (rps, tokens, flood_rps), (c_rps, c_tokens, c_flood) = total(uncapped), total(capped)
    return CapsCost(
        scenario=scenario,
        served_rps=(rps, c_rps),
        served_tokens_per_s=(tokens, c_tokens),
        flood=flood,
        flood_rps=(flood_rps, c_flood),
        others_rps=(round(rps - flood_rps, 2), round(c_rps - c_flood, 2)),
        capacity_rps=capacity_rps,
    )


def caps_cost_table(rows: Sequence[CapsCost]) -> list[str]:
    lines = [
        "| scenario | served req/s, plain / second config | of capacity, plain / second config "
        "| served tokens/s (prompt + output), plain / second config | the flood's req/s "
        "| the others' req/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def pair(values: tuple[float, float], spec: str) -> str:
        return f"{values[0]:{spec}} / {values[1]:{spec}}"

    for c in rows:
        share = (c.served_rps[0] / c.capacity_rps, c.served_rps[1] / c.capacity_rps)
        lines.append(
            f"| {c.scenario} | {pair(c.served_rps, '.1f')} | {pair(share, '.0%')} "
            f"| {pair(c.served_tokens_per_s, '.0f')} | {c.flood}: {pair(c.flood_rps, '.1f')} "
            f"| {pair(c.others_rps, '.1f')} |"
        )
    return lines
