"""The phases run's report: ``report.md``, ``report.json``, ``report.csv``,
``requests.csv`` and ``timeline.png``.

Owns the layout of the phases report. ``report.csv`` is the timeline (one
row per bin); ``requests.csv`` has one row per request with its outcome, so
anyone can recount goodput from it. Shared formatting comes from ``report``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.loadtest.capacity import PEAK_GOOD, STABLE_GOOD
from proxy.loadtest.client import ENDPOINTS
from proxy.loadtest.plots import plot_timeline
from proxy.loadtest.report import (
    NO_PLOTS,
    fmt_counts,
    fmt_ms,
    fmt_num,
    md_table,
    plotting_available,
    write_csv,
    write_json,
)
from proxy.loadtest.timeline import GroupSummary, classify

if TYPE_CHECKING:
    from proxy.loadtest.phases import PhasesResult
    from proxy.loadtest.results import RequestResult

__all__ = ["PHASES_FILES", "phases_markdown", "write_phases_report"]

PHASES_FILES = ("report.md", "report.json", "report.csv", "requests.csv", "timeline.png")


def _group_rows(groups: Sequence[GroupSummary], extra: Mapping[str, str]) -> list[list[str]]:
    rows = []
    for group in groups:
        ratio = group.goodput_ratio
        rows.append(
            [
                group.name,
                extra.get(group.name, ""),
                fmt_num(group.asked_rate_per_s),
                fmt_num(group.achieved_rate_per_s),
                str(group.sent),
                str(group.good),
                fmt_num(group.goodput_per_s),
                "-" if ratio is None else f"{ratio:.0%}",
                str(group.outcomes.get("slo_missed", 0)),
                fmt_counts(group.rejections),
                fmt_ms(group.ttft_p50_ms),
                fmt_ms(group.ttft_p95_ms),
                fmt_ms(group.latency_p95_ms),
                fmt_num(group.queue_depth_max, 0),
                fmt_num(group.retries, 0),
            ]
        )
    return rows


_GROUP_HEADER = [
    "asked req/s", "achieved req/s", "sent", "good", "goodput/s", "good %", "SLO missed",
    "rejected or failed (by reason)", "TTFT p50 ms", "TTFT p95 ms", "latency p95 ms",
    "max queue", "retries",
]  # fmt: skip


def phases_markdown(result: PhasesResult, *, plots: bool = True) -> str:
    summary, workload = result.summary, result.workload
    total, drain = summary.total, summary.drain
    ratio = total.goodput_ratio
    drain_text = (
        "never drained before the run ended"
        if drain.drain_s is None and drain.depth_at_end is not None
        else "no queue metrics from the target"
        if drain.depth_at_end is None
        else f"{drain.drain_s:.1f} s"
    )
    lines = [
        "# Phases load test",
        "",
        f"- target: {result.base_url} (model `{result.model}`, `{ENDPOINTS[workload.endpoint]}`)",
        f"- workload: {result.workload_source}, seed {workload.seed}; "
        f"started {result.started}, took {result.duration_s:.0f} s",
        f"- offered: {len(result.arrivals)} requests scheduled (Poisson), "
        f"asked {fmt_num(total.asked_rate_per_s)} req/s on average, "
        f"achieved {fmt_num(total.achieved_rate_per_s)} req/s "
        f"(send lag p99 {fmt_ms(total.send_lag_p99_ms)} ms, "
        f"event-loop lag p99 {fmt_ms(result.loop_lag_p99_ms)} ms)",
        "",
        "## Summary",
        "",
        f"- **goodput: {total.goodput_per_s:.2f} req/s**: {total.good} of {total.sent} requests "
        f"succeeded within every SLO ({'-' if ratio is None else f'{ratio:.1%}'})",
        f"- succeeded but missed an SLO: {total.outcomes.get('slo_missed', 0)}",
        f"- rejected or failed, by reason: {fmt_counts(total.rejections)}",
        f"- queue drain after `{drain.phase}`: {drain_text} "
        f"(depth {fmt_num(drain.depth_at_end, 0)} at its end; resolution {drain.resolution_s:g} s)",
        f"- proxy retries by reason: {fmt_counts(summary.retries_by_reason)}"
        + (
            f"; refused by the retry budget: {summary.retry_budget_exhausted:g}"
            if summary.retry_budget_exhausted
            else ""
        ),
    ]
    if result.generator_notes:
        lines += [f"- generator: {note}" for note in result.generator_notes]
    faults = {
        w.name: ", ".join(f"{k}={v}" for k, v in w.phase.fault.settings().items())
        for w in result.windows
        if w.phase.fault is not None
    }
    lines += ["", "## Phases", ""]
    lines += md_table(
        ["phase", "fault", *_GROUP_HEADER],
        _group_rows(summary.phases, faults),
        "llrrrrrrrlrrrrr",
    )
    slos = {}
    for name, tenant in workload.tenants.items():
        slo = workload.slo_for(name)
        parts = [
            f"{label} {value:g} ms"
            for label, value in (
                ("TTFT", slo.ttft_ms),
                ("TPOT", slo.tpot_ms),
                ("total", slo.total_ms),
            )
            if value is not None
        ]
        slos[name] = f"{tenant.priority or 'default'}; " + (", ".join(parts) or "no SLO")
    lines += ["", "## Tenants", ""]
    lines += md_table(
        ["tenant", "class; SLO", *_GROUP_HEADER],
        _group_rows(summary.tenants, slos),
        "llrrrrrrrlrrrrr",
    )
    lines += [
        "",
        "A request is **good** when it succeeded and met every SLO of its tenant (TTFT, time "
        "per output token, total). Every sent request is counted once: good, SLO missed, or "
        "under the reason it failed (the proxy's `X-Admission-Reason`, else the client's error).",
        "",
        "## Timeline",
        "",
        "![timeline](timeline.png)" if plots else NO_PLOTS,
        "",
        "`report.csv` holds the timeline per "
        f"{workload.timeline_bin_s:g} s bin; `requests.csv` one row per request.",
        "",
    ]
    lines += _capacity_section(result)
    return "\n".join(lines)


def _capacity_section(result: PhasesResult) -> list[str]:
    """The capacity table, last: four figures from this run, each with its config."""
    config = result.config
    lines = ["## Capacity", ""]
    lines += md_table(
        ["", "measured", "from", "config"],
        ([f"**{row.title}**", row.value_text(), row.detail, row.config] for row in result.capacity),
        "lrll",
    )
    lines += [
        "",
        f"Stable load: the busiest fault-free phase with at least {STABLE_GOOD:.0%} of its "
        f"requests good; acceptable peak: the same with at least {PEAK_GOOD:.0%}; burst "
        "protection: how long the queues took to empty after the burst, and what the burst "
        "cost; fault degradation: the good share while a fault was on. "
        + (
            f"Config `{config.short}` is the SHA-256 of the proxy's `GET /admin/config` "
            "(the effective config, secrets masked) during this run."
            if config is not None
            else "The proxy's config was not readable (`GET /admin/config`): no fingerprint."
        ),
        "",
    ]
    return lines


def _phases_csv(path: Path, result: PhasesResult) -> None:
    fields = [
        "start_s", "end_s", "phase", "offered_per_s", "sent_per_s", "ok_per_s", "goodput_per_s",
        "rejected_per_s", "rejections", "queue_depth", "inflight", "retries_per_s",
        "latency_p95_ms",
    ]  # fmt: skip
    write_csv(path, fields, (
        {**row.to_json(), "rejections": ";".join(f"{k}={v}" for k, v in row.rejections.items())}
        for row in result.summary.timeline
    ))  # fmt: skip


def _requests_csv(path: Path, result: PhasesResult) -> None:
    fields = [
        "index", "phase", "tenant", "request_class", "due_at", "started_at", "ended_at",
        "status", "error", "reason", "ttft_ms", "latency_ms", "tpot_ms", "input_tokens",
        "output_tokens", "queue_ms", "outcome",
    ]  # fmt: skip
    workload = result.workload

    def row(r: RequestResult) -> dict[str, object]:
        """Times in ms; ``write_csv`` rounds them and leaves what is missing empty."""
        ttft, tpot = r.ttft_s, r.tpot_s
        return {
            "index": r.index, "phase": r.phase, "tenant": r.tenant,
            "request_class": r.request_class, "due_at": r.due_at, "started_at": r.started_at,
            "ended_at": r.ended_at, "status": r.status, "error": r.error, "reason": r.reason,
            "ttft_ms": None if ttft is None else ttft * 1000,
            "latency_ms": r.latency_s * 1000,
            "tpot_ms": None if tpot is None else tpot * 1000,
            "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
            "queue_ms": r.queue_ms, "outcome": classify(r, workload.slo_for(r.tenant)),
        }  # fmt: skip

    write_csv(path, fields, (row(r) for r in sorted(result.results, key=lambda r: r.index)))


def write_phases_report(result: PhasesResult, out_dir: Path) -> list[Path]:
    """Write every phases report file into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, workload = result.summary, result.workload
    write_json(
        out_dir / "report.json",
        {
            "kind": "phases",
            "target": result.base_url,
            "model": result.model,
            "workload": result.workload_source,
            "started": result.started,
            "duration_s": result.duration_s,
            "seed": workload.seed,
            "phases": [
                {
                    "name": w.name,
                    "start_s": w.start_s,
                    "end_s": w.end_s,
                    "rate_per_s": w.phase.rate_per_s,
                    "to_rate_per_s": w.phase.to_rate_per_s,
                    "fault": None if w.phase.fault is None else w.phase.fault.settings(),
                    **summary.phases[i].to_json(),
                }
                for i, w in enumerate(result.windows)
            ],
            "total": summary.total.to_json(),
            "goodput_per_s": summary.total.goodput_per_s,
            "good": summary.total.good,
            "sent": summary.total.sent,
            "rejections": summary.total.rejections,
            "tenants": [
                {"slo": workload.slo_for(t.name).model_dump(), **t.to_json()}
                for t in summary.tenants
            ],
            "drain": summary.drain.to_json(),
            "retries_by_reason": dict(summary.retries_by_reason),
            "retry_budget_exhausted": summary.retry_budget_exhausted,
            "timeline": [row.to_json() for row in summary.timeline],
            "queue_depth_samples": [
                {"t": s.t, "depth": s.total_depth, "by_queue": dict(s.queue_depth)}
                for s in sorted(result.samples, key=lambda s: s.t)
            ],
            "config": None
            if result.config is None
            else {"sha256": result.config.sha256, "summary": dict(result.config.summary)},
            "capacity": {row.name: row.to_json() for row in result.capacity},
            "generator": {
                "loop_lag_p99_ms": result.loop_lag_p99_ms,
                "cpu_ratio": result.cpu_ratio,
                "overloaded": result.overloaded,
                "unfinished": result.unfinished,
                "notes": result.generator_notes,
            },
        },
    )
    _phases_csv(out_dir / "report.csv", result)
    _requests_csv(out_dir / "requests.csv", result)
    plots = plotting_available()
    if plots:
        plot_timeline(summary, result.windows, out_dir / "timeline.png")
    (out_dir / "report.md").write_text(phases_markdown(result, plots=plots), encoding="utf-8")
    return [out_dir / name for name in PHASES_FILES if plots or not name.endswith(".png")]
