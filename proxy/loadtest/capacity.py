"""The capacity table that ends a phases run: four figures, each with the config behind it.

Owns ``capacity_table`` (pure: the run's summary, windows, results and the
proxy's config fingerprint in, four ``CapacityRow`` out). The operator notes
ask a capacity test to answer with operating bounds and the protection that
holds them, not one "maximum concurrency"; these are the four rows, each
measured from the run:

- **stable load**: the highest rate (requests sent per second, over a whole
  phase) of a fault-free phase in which at least ``STABLE_GOOD`` (95%) of the
  requests were good (succeeded within every SLO of their tenant);
- **acceptable peak**: the same with at least ``PEAK_GOOD`` (80%) good: the
  load the service carries while shedding or slowing a bounded share;
- **burst protection**: how long the queues took to empty after the burst
  phase (``drain_after``), with what the burst cost: its good share, what was
  refused and why, the deepest queue, the good share per tenant;
- **fault degradation**: the good share and goodput during the phases with a
  fault (a simulator fault, or a real engine frozen by ``pause``), against
  the stable phase's, and the proxy's retries.

A row whose phase does not exist (no fault phase, no phase good enough) has
no value and says why. Every row carries the config fingerprint (SHA-256 of
the proxy's effective config) and the knobs that shape that row. No I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.loadtest.results import RequestResult
from proxy.loadtest.schedule import PhaseWindow
from proxy.loadtest.target import ConfigFingerprint
from proxy.loadtest.timeline import GOOD, NOT_SENT, GroupSummary, PhasesSummary, classify
from proxy.loadtest.workload import Workload

__all__ = ["PEAK_GOOD", "ROWS", "STABLE_GOOD", "CapacityRow", "capacity_table"]

#: Good share a phase must keep to count as stable load.
STABLE_GOOD = 0.95
#: Good share a phase must keep to count as an acceptable peak.
PEAK_GOOD = 0.80
ROWS = ("stable_load", "acceptable_peak", "burst_protection", "fault_degradation")
TITLES = {
    "stable_load": "stable load",
    "acceptable_peak": "acceptable peak",
    "burst_protection": "burst protection",
    "fault_degradation": "fault degradation",
}
#: The config knobs shown next to each row.
ROW_KNOBS = {
    "stable_load": ("seats",),
    "acceptable_peak": ("seats", "queues"),
    "burst_protection": ("seats", "queues"),
    "fault_degradation": ("seats", "retry"),
}


@dataclass(frozen=True, slots=True)
class CapacityRow:
    """One row: its measured ``value`` (in ``unit``), the phase it came from, and the config."""

    name: str
    value: float | None
    unit: str
    phase: str | None
    detail: str
    config: str
    figures: Mapping[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return TITLES[self.name]

    def value_text(self) -> str:
        if self.value is None:
            return "not measured"
        if self.unit == "%":
            return f"{self.value:.0%} good"
        return f"{self.value:.2f} {self.unit}" if self.unit != "s" else f"{self.value:.1f} s"

    def to_json(self) -> dict[str, object]:
        return {
            "value": self.value,
            "unit": self.unit,
            "phase": self.phase,
            "detail": self.detail,
            "config": self.config,
            "figures": dict(self.figures),
        }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _rate(group: GroupSummary) -> float:
    return group.achieved_rate_per_s or 0.0


def _load_row(
    name: str, phases: Sequence[GroupSummary], threshold: float, config: str
) -> CapacityRow:
    """The busiest fault-free phase that kept ``threshold`` of its requests good."""
    fit = [p for p in phases if p.sent and (p.goodput_ratio or 0.0) >= threshold]
    if not fit:
        best = max(phases, key=lambda p: p.goodput_ratio or 0.0, default=None)
        why = f"no fault-free phase kept {threshold:.0%} of its requests good"
        if best is not None:
            why += f" (best: {best.name}, {_pct(best.goodput_ratio)})"
        return CapacityRow(name, None, "req/s", None, why, config)
    top = max(fit, key=_rate)
    refused = sum(top.rejections.values())
    detail = (
        f"{top.name}: {_rate(top):.2f} req/s sent ({top.asked_rate_per_s or 0:.2f} asked), "
        f"goodput {top.goodput_per_s:.2f} req/s, {_pct(top.goodput_ratio)} good, "
        f"{refused} refused or failed, TTFT p95 "
        + ("-" if top.ttft_p95_ms is None else f"{top.ttft_p95_ms:.0f} ms")
    )
    figures = {
        "rate_per_s": _rate(top),
        "asked_rate_per_s": top.asked_rate_per_s,
        "goodput_per_s": top.goodput_per_s,
        "good_ratio": top.goodput_ratio,
        "refused": refused,
        "threshold": threshold,
    }
    return CapacityRow(name, _rate(top), "req/s", top.name, detail, config, figures)


def _tenant_good(
    results: Sequence[RequestResult], workload: Workload, phase: str
) -> dict[str, float]:
    """Good share per tenant among the requests of one phase."""
    sent: Counter[str] = Counter()
    good: Counter[str] = Counter()
    for r in results:
        if r.phase != phase or r.error in NOT_SENT:
            continue
        sent[r.tenant] += 1
        if classify(r, workload.slo_for(r.tenant)) == GOOD:
            good[r.tenant] += 1
    return {tenant: good[tenant] / count for tenant, count in sent.items() if count}


def _burst_row(
    summary: PhasesSummary,
    results: Sequence[RequestResult],
    workload: Workload,
    config: str,
) -> CapacityRow:
    drain = summary.drain
    burst = next((p for p in summary.phases if p.name == drain.phase), None)
    if burst is None:
        return CapacityRow("burst_protection", None, "s", None, "no burst phase", config)
    tenants = _tenant_good(results, workload, burst.name)
    rejections = ", ".join(f"{k} {v}" for k, v in burst.rejections.items()) or "none"
    if drain.depth_at_end is None:
        drained = "queue depth unknown (no proxy metrics)"
    elif drain.drain_s is None:
        drained = "queues never emptied before the run ended"
    else:
        drained = f"queues empty {drain.drain_s:.1f} s after it"
    detail = (
        f"{burst.name}: {_rate(burst):.2f} req/s sent, {_pct(burst.goodput_ratio)} good, "
        f"refused or failed: {rejections}; deepest queue "
        + ("-" if burst.queue_depth_max is None else f"{burst.queue_depth_max:g}")
        + f"; {drained}; good by tenant: "
        + (", ".join(f"{t} {_pct(v)}" for t, v in sorted(tenants.items())) or "-")
    )
    figures = {
        "drain_s": drain.drain_s,
        "rate_per_s": _rate(burst),
        "good_ratio": burst.goodput_ratio,
        "rejections": dict(burst.rejections),
        "queue_depth_max": burst.queue_depth_max,
        "good_ratio_by_tenant": tenants,
    }
    return CapacityRow("burst_protection", drain.drain_s, "s", burst.name, detail, config, figures)


def _fault_row(
    summary: PhasesSummary,
    windows: Sequence[PhaseWindow],
    stable: CapacityRow,
    config_of: ConfigFingerprint | None,
) -> CapacityRow:
    faulted = {w.name: w for w in windows if w.phase.fault is not None}
    base = _config_text(config_of, ROW_KNOBS["fault_degradation"])
    phases = [p for p in summary.phases if p.name in faulted]
    if not phases:
        return CapacityRow(
            "fault_degradation", None, "%", None, "no phase switched a fault on", base
        )
    sent = sum(p.sent for p in phases)
    good = sum(p.good for p in phases)
    ratio = good / sent if sent else None
    goodput = sum(p.good for p in phases) / sum(p.duration_s for p in phases)
    retries = sum(p.retries or 0.0 for p in phases)
    settings = "; ".join(
        f"{name}: " + ", ".join(f"{k}={v}" for k, v in w.phase.fault.settings().items())
        for name, w in faulted.items()
        if w.phase.fault is not None
    )
    stable_ratio = stable.figures.get("good_ratio")
    compare = (
        f" (stable load, {stable.phase}: {_pct(stable_ratio)})" if stable.phase is not None else ""
    )
    detail = (
        f"{', '.join(p.name for p in phases)}: {_pct(ratio)} good{compare}, "
        f"goodput {goodput:.2f} req/s, proxy retries {retries:g}"
    )
    figures = {
        "good_ratio": ratio,
        "goodput_per_s": goodput,
        "retries": retries,
        "stable_good_ratio": stable_ratio,
        "faults": {name: w.phase.fault.settings() for name, w in faulted.items() if w.phase.fault},
    }
    return CapacityRow(
        "fault_degradation",
        ratio,
        "%",
        ", ".join(p.name for p in phases),
        detail,
        f"{base}; fault {settings}",
        figures,
    )


def _config_text(config: ConfigFingerprint | None, knobs: Sequence[str]) -> str:
    if config is None:
        return "proxy config unknown (its /admin/config did not answer)"
    return config.describe(*knobs)


def capacity_table(
    summary: PhasesSummary,
    windows: Sequence[PhaseWindow],
    results: Sequence[RequestResult],
    workload: Workload,
    config: ConfigFingerprint | None,
) -> tuple[CapacityRow, ...]:
    """The four rows, in ``ROWS`` order, measured from one phases run."""
    faulted = {w.name for w in windows if w.phase.fault is not None}
    clean = [p for p in summary.phases if p.name not in faulted]
    stable = _load_row(
        "stable_load", clean, STABLE_GOOD, _config_text(config, ROW_KNOBS["stable_load"])
    )
    peak = _load_row(
        "acceptable_peak", clean, PEAK_GOOD, _config_text(config, ROW_KNOBS["acceptable_peak"])
    )
    burst = _burst_row(
        summary, results, workload, _config_text(config, ROW_KNOBS["burst_protection"])
    )
    fault = _fault_row(summary, windows, stable, config)
    return stable, peak, burst, fault
