"""The retry-storm benchmark's records, figures and markdown tables.

A ``Run`` is one policy's raw results: each client request (``Result``), the
proxy's access-log line for it (``Entry``, which carries its upstream
attempts) and the replicas' own request counters. ``run_stats`` turns a run
into figures over the requests due in its measured window; ``summarize``
takes the median of each figure over the rounds; ``figures`` judges the
targets. Nothing here does I/O.

Two counts of upstream attempts are kept apart on purpose:

- from the access log, per request: exact, and over exactly the requests the
  other figures describe;
- from the replicas (``requests_total`` read when the window opens and
  closes): independent of the proxy, but over a time window, which lags the
  requests due in it by their queueing time.

Over the whole run (everything after the proxy's warm-up) the two must agree
exactly; ``Stats.log_total`` and ``Stats.replicas_total`` show that they do.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bench.common import FigureBase, access_log_requests
from bench.load import percentile

# -- records ----------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    """One client request."""

    request_id: str
    #: Scheduled send time, seconds from the start of the run.
    due_s: float
    status: int = 0
    #: ``""`` for a 200; else the ``X-Admission-Reason``, ``status N``, an
    #: exception name or ``unfinished``.
    reason: str = "unfinished"
    total_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.reason


@dataclass(slots=True)
class Entry:
    """One request's line of the proxy's access log (the fields used here)."""

    attempts: int
    outcome: str
    reason: str
    replica: str | None


def read_access_log(text: str) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for event in access_log_requests(text):
        replica = event.get("replica")
        entries[str(event["request_id"])] = Entry(
            int(event.get("attempts") or 0),
            str(event.get("outcome")),
            str(event.get("reason")),
            None if replica is None else str(replica),
        )
    return entries


@dataclass(slots=True)
class Run:
    policy: str
    round: int
    rate: float
    window: tuple[float, float]
    results: list[Result]
    log: dict[str, Entry]
    #: Per replica, requests the engine received while the window was open
    #: (None: a replica's counters could not be read at one end of it).
    replicas_in_window: list[int] | None
    #: Per replica, requests received from the fault's start to the proxy's stop (None: missing).
    replicas_total: list[int] | None
    errors_injected: int | None
    retry_budget_exhausted: float
    elapsed_s: float
    #: CPU seconds over the run: this process (load generator and proxy) and each replica.
    cpu_s: dict[str, float] = field(default_factory=dict)
    #: Readings that could not be taken (``bench.common.MissingReading`` as text).
    missing: list[str] = field(default_factory=list)


# -- one run's figures ------------------------------------------------------------------


def _ratio(top: float, bottom: float) -> float:
    return top / bottom if bottom else float("nan")


def slo_label(slo_ms: float) -> str:
    return "inf" if math.isinf(slo_ms) else f"{slo_ms:.0f}"


@dataclass(slots=True)
class Stats:
    """One run's figures over the requests due in its measured window."""

    policy: str
    round: int
    seconds: float
    sent: int
    #: Requests that made at least one upstream attempt.
    dispatched: int
    attempts_log: int
    #: None where the replicas' counters are missing (``missing``).
    attempts_replicas: int | None
    per_sent_log: float
    per_sent_replicas: float
    per_dispatched_log: float
    per_dispatched_replicas: float
    retries_per_s: float
    ok: int
    good: int
    goodput_rps: float
    good_share: float
    p50_ok_ms: float
    p99_ok_ms: float
    p99_answered_ms: float
    #: Answers by ``X-Admission-Reason`` ("ok" for 200).
    reasons: dict[str, int]
    #: Goodput (req/s) at other SLOs on total time, in ms ("inf": every 200).
    goodput_by_slo: dict[str, float]
    #: Requests by upstream attempts made (from the access log).
    attempts_histogram: dict[str, int]
    #: Retried requests whose last attempt went to the failing replica again.
    retried_on_faulty: int
    retry_budget_exhausted: float
    replicas_in_window: list[int] | None
    #: Whole run: attempts by the access log, and requests the replicas received.
    log_total: int
    replicas_total: int | None
    errors_injected: int | None
    unlogged: int
    cpu_s: dict[str, float]
    #: Readings that could not be taken in this run: its replica figures are n/a.
    missing: list[str] = field(default_factory=list)


def run_stats(run: Run, slo_ms: float, slo_sweep_ms: Sequence[float], faulty: str) -> Stats:
    lo, hi = run.window
    seconds = hi - lo
    measured = [r for r in run.results if lo <= r.due_s < hi]
    entries = [run.log.get(r.request_id) for r in measured]
    logged = [e for e in entries if e is not None]
    dispatched = [e for e in logged if e.attempts >= 1]
    attempts_log = sum(e.attempts for e in logged)
    in_window = run.replicas_in_window
    attempts_replicas = None if in_window is None else sum(in_window)
    nan = float("nan")
    ok_ms = [r.total_s * 1000.0 for r in measured if r.ok and r.total_s is not None]
    answered_ms = [r.total_s * 1000.0 for r in measured if r.total_s is not None]
    good = sum(ms <= slo_ms for ms in ok_ms)
    sent = len(measured)
    return Stats(
        policy=run.policy,
        round=run.round,
        seconds=seconds,
        sent=sent,
        dispatched=len(dispatched),
        attempts_log=attempts_log,
        attempts_replicas=attempts_replicas,
        per_sent_log=_ratio(attempts_log, sent),
        per_sent_replicas=nan if attempts_replicas is None else _ratio(attempts_replicas, sent),
        per_dispatched_log=_ratio(attempts_log, len(dispatched)),
        per_dispatched_replicas=(
            nan if attempts_replicas is None else _ratio(attempts_replicas, len(dispatched))
        ),
        retries_per_s=(attempts_log - len(dispatched)) / seconds,
        ok=len(ok_ms),
        good=good,
        goodput_rps=good / seconds,
        good_share=_ratio(good, sent),
        p50_ok_ms=percentile(sorted(ok_ms), 0.50),
        p99_ok_ms=percentile(sorted(ok_ms), 0.99),
        p99_answered_ms=percentile(sorted(answered_ms), 0.99),
        reasons=dict(Counter(r.reason or "ok" for r in measured).most_common()),
        goodput_by_slo={
            slo_label(slo): sum(ms <= slo for ms in ok_ms) / seconds for slo in slo_sweep_ms
        },
        attempts_histogram=dict(sorted(Counter(str(e.attempts) for e in logged).items())),
        retried_on_faulty=sum(e.attempts >= 2 and e.replica == faulty for e in logged),
        retry_budget_exhausted=run.retry_budget_exhausted,
        replicas_in_window=run.replicas_in_window,
        log_total=sum(e.attempts for e in run.log.values()),
        replicas_total=None if run.replicas_total is None else sum(run.replicas_total),
        errors_injected=run.errors_injected,
        unlogged=sum(e is None for e in entries),
        cpu_s=run.cpu_s,
        missing=list(run.missing),
    )


# -- over the rounds --------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else float("nan")


@dataclass(slots=True)
class Summary:
    """A policy's figures: the median over rounds of each."""

    policy: str
    rounds: int
    sent_rps: float
    dispatched_rps: float
    per_sent_log: float
    per_sent_replicas: float
    per_dispatched_log: float
    per_dispatched_replicas: float
    retries_per_s: float
    goodput_rps: float
    good_share: float
    p50_ok_ms: float
    p99_ok_ms: float
    p99_answered_ms: float
    #: Answers per second by reason.
    reasons: dict[str, float]
    goodput_by_slo: dict[str, float]


def summarize(policy: str, stats: Sequence[Stats]) -> Summary:
    def med(name: str) -> float:
        return median([float(getattr(s, name)) for s in stats])

    reasons = {
        key: median([s.reasons.get(key, 0) / s.seconds for s in stats])
        for key in {k for s in stats for k in s.reasons}
    }
    slos = {k: median([s.goodput_by_slo[k] for s in stats]) for k in stats[0].goodput_by_slo}
    return Summary(
        policy=policy,
        rounds=len(stats),
        sent_rps=median([s.sent / s.seconds for s in stats]),
        dispatched_rps=median([s.dispatched / s.seconds for s in stats]),
        per_sent_log=med("per_sent_log"),
        per_sent_replicas=med("per_sent_replicas"),
        per_dispatched_log=med("per_dispatched_log"),
        per_dispatched_replicas=med("per_dispatched_replicas"),
        retries_per_s=med("retries_per_s"),
        goodput_rps=med("goodput_rps"),
        good_share=med("good_share"),
        p50_ok_ms=med("p50_ok_ms"),
        p99_ok_ms=med("p99_ok_ms"),
        p99_answered_ms=med("p99_answered_ms"),
        reasons=dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        goodput_by_slo=slos,
    )


# -- targets ----------------------------------------------------------------------------


@dataclass(slots=True)
class Figure(FigureBase):
    detail: str = ""
    percent: bool = False


def _paired(
    stats: Mapping[str, Sequence[Stats]], top: str, bottom: str
) -> list[tuple[Stats, Stats]]:
    by_round = {s.round: s for s in stats[bottom]}
    return [(s, by_round[s.round]) for s in stats[top] if s.round in by_round]


def figures(
    summaries: Mapping[str, Summary],
    stats: Mapping[str, Sequence[Stats]],
    *,
    max_attempts: float,
    min_retries_per_s: float,
    max_floor_share: float,
) -> list[Figure]:
    """The judged figures (budgeted against its targets and against naive) and context."""
    out: list[Figure] = []
    budgeted, naive = summaries.get("budgeted"), summaries.get("naive")
    if budgeted is not None:
        rounds = stats["budgeted"]
        worst = max(s.per_dispatched_log for s in rounds)
        out.append(Figure(
            "budgeted: upstream attempts per dispatched request (access log)",
            budgeted.per_dispatched_log, f"< {max_attempts}", worst < max_attempts,
            "worst round " + f"{worst:.3f}; replicas' count over the window "
            f"{budgeted.per_dispatched_replicas:.3f}",
        ))  # fmt: skip
        worst_sent = max(s.per_sent_log for s in rounds)
        naive_sent = "" if naive is None else f"; naive {naive.per_sent_log:.3f}"
        out.append(Figure(
            "budgeted: upstream attempts per client request sent (access log)",
            budgeted.per_sent_log, f"< {max_attempts} (the issue's wording)",
            worst_sent < max_attempts,
            f"worst round {worst_sent:.3f}; replicas' count over the window "
            f"{budgeted.per_sent_replicas:.3f}{naive_sent}",
        ))  # fmt: skip
        floor_share = _ratio(min_retries_per_s, budgeted.dispatched_rps)
        out.append(Figure(
            "retry floor over budgeted's dispatch rate", floor_share,
            f"< {max_floor_share:.0%} (precondition)", floor_share < max_floor_share,
            f"{min_retries_per_s:g}/s over {budgeted.dispatched_rps:.0f} req/s", percent=True,
        ))  # fmt: skip
    if budgeted is not None and naive is not None:
        pairs = _paired(stats, "budgeted", "naive")
        ratios = [_ratio(b.goodput_rps, n.goodput_rps) for b, n in pairs]
        ratio = median(ratios)
        out.append(Figure(
            "goodput: budgeted / naive (median of per-round ratios)", ratio, ">= 1.0",
            ratio >= 1.0, "per round: " + ", ".join(f"{r:.3f}" for r in ratios),
        ))  # fmt: skip
        every = [_ratio(b.goodput_by_slo["inf"], n.goodput_by_slo["inf"]) for b, n in pairs]
        out.append(Figure(
            "every 200, whatever its latency: budgeted / naive", median(every), "(reported)",
            None, "per round: " + ", ".join(f"{r:.3f}" for r in every),
        ))  # fmt: skip
        out.append(Figure(
            "attempts per dispatched request: budgeted / naive",
            _ratio(budgeted.per_dispatched_log, naive.per_dispatched_log), "(reported)", None,
        ))  # fmt: skip
        p99 = median([_ratio(b.p99_ok_ms, n.p99_ok_ms) for b, n in pairs])
        out.append(Figure("p99 latency of 200s: budgeted / naive", p99, "(reported)", None))
    return out


# -- markdown ---------------------------------------------------------------------------


def _f(value: float, digits: int = 1) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.{digits}f}"


def _n(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def missing_report(stats: Mapping[str, Sequence[Stats]]) -> list[str]:
    """How many readings were missing, and each one with its round and policy."""
    every = sorted((s for group in stats.values() for s in group), key=lambda s: s.round)
    lines = [f"readings missing: {sum(len(s.missing) for s in every)}"]
    lines += [f"- round {s.round} {s.policy}: {m}" for s in every for m in s.missing]
    return lines


def policy_table(summaries: Sequence[Summary], titles: Mapping[str, str]) -> list[str]:
    lines = [
        "| policy | sent req/s | dispatched req/s | attempts / sent | attempts / dispatched | "
        "retries/s | goodput req/s | goodput / sent | p50 ms (200s) | p99 ms (200s) | "
        "p99 ms (every answer) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        lines.append(
            f"| {titles[s.policy]} | {_f(s.sent_rps)} | {_f(s.dispatched_rps)} | "
            f"{_f(s.per_sent_log, 3)} | {_f(s.per_dispatched_log, 3)} | {_f(s.retries_per_s)} | "
            f"{_f(s.goodput_rps)} | {s.good_share:.1%} | {_f(s.p50_ok_ms, 0)} | "
            f"{_f(s.p99_ok_ms, 0)} | {_f(s.p99_answered_ms, 0)} |"
        )
    return lines


def reasons_table(summaries: Sequence[Summary], titles: Mapping[str, str]) -> list[str]:
    keys = sorted({k for s in summaries for k in s.reasons}, key=lambda k: (k != "ok", k))
    lines = [
        "| answer (req/s) | " + " | ".join(titles[s.policy] for s in summaries) + " |",
        "|---|" + "---:|" * len(summaries),
    ]
    for key in keys:
        label = "200" if key == "ok" else key
        cells = " | ".join(_f(s.reasons.get(key, 0.0)) for s in summaries)
        lines.append(f"| {label} | {cells} |")
    return lines


def slo_table(summaries: Sequence[Summary], titles: Mapping[str, str]) -> list[str]:
    slos = list(summaries[0].goodput_by_slo) if summaries else []
    heads = " | ".join("every 200" if k == "inf" else f"<= {k} ms" for k in slos)
    lines = ["| goodput (req/s) by SLO on total time | " + heads + " |",
             "|---|" + "---:|" * len(slos)]  # fmt: skip
    for s in summaries:
        cells = " | ".join(_f(s.goodput_by_slo[k]) for k in slos)
        lines.append(f"| {titles[s.policy]} | {cells} |")
    return lines


def rounds_table(stats: Mapping[str, Sequence[Stats]]) -> list[str]:
    lines = [
        "| round | policy | sent | dispatched | attempts (log; replicas) | "
        "attempts / dispatched (log; replicas) | requests by attempts | retried, last attempt "
        "on the failing replica | 200s | good | "
        "p99 ms (200s) | whole run: attempts by log / by replicas | CPU s (this process; "
        "replicas) |",
        "|---:|---|---:|---:|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    every = sorted((s for group in stats.values() for s in group), key=lambda s: s.round)
    for s in every:
        histogram = ", ".join(f"{k}: {v}" for k, v in s.attempts_histogram.items())
        cpu = s.cpu_s.get("self", 0.0)
        sims = "+".join(f"{v:.1f}" for k, v in s.cpu_s.items() if k != "self")
        lines.append(
            f"| {s.round} | {s.policy} | {s.sent} | {s.dispatched} | "
            f"{s.attempts_log}; {_n(s.attempts_replicas)} | "
            f"{_f(s.per_dispatched_log, 3)}; {_f(s.per_dispatched_replicas, 3)} | {histogram} | "
            f"{s.retried_on_faulty} | {s.ok} | {s.good} | {_f(s.p99_ok_ms, 0)} | "
            f"{s.log_total} / {_n(s.replicas_total)} | "
            f"{cpu:.1f}; {sims} |"
        )
    return lines


def figure_table(items: Sequence[Figure]) -> list[str]:
    lines = ["| figure | value | target |", "|---|---:|---|"]
    for f in items:
        verdict = "" if f.passed is None else (" PASS" if f.passed else " MISS")
        detail = f" ({f.detail})" if f.detail else ""
        value = f"{f.value:.1%}" if f.percent else _f(f.value, 3)
        lines.append(f"| {f.name}{detail} | {value} | {f.target}{verdict} |")
    return lines
