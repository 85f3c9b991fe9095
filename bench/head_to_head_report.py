"""Figures of the head-to-head benchmark: one ``Phase`` per target and load, and its tables.

Owns the definitions the report states:

- *good*: ``[DONE]`` arrived before the deadline, with TTFT and total time
  within the SLO; goodput is good requests per second of the measured window
  (vLLM's definition).
- *achieved*: on-time completions per second, good or not.
- *rejected*: answers with a 4xx/5xx status; *gave up*: the client's deadline
  passed first (while waiting for the first token, or mid-stream).
- *wasted completions*: completions the engines finished (``/sim/stats``
  ``completed``, summed over the replicas) that no client received on time.
  Each engine completion belongs to one request, so this is the engines'
  count minus the clients' on-time completions, over the whole phase
  (warm-up included, after every stream has ended).
- *mean batch* and *engine rate*: over the measured window alone (two
  ``/sim/stats`` snapshots), tokens generated per decode step (the engines'
  mean running batch: ``SLOTS`` when no seat ever stood empty) and
  completions per second: what each front made of the same engines.
- *wasted tokens*: tokens the engines generated (``tokens_generated``) minus
  the tokens of the on-time completions: also counts the partial output of
  requests whose client left mid-stream, which the engine then aborted.

A reading that could not be taken (an engine too busy to answer its
``/metrics``) leaves the figures built on it ``None``, printed
``n/a``; each phase lists its missing readings and the report counts them.

No I/O here: the caller measures, this module counts and prints.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bench.head_to_head_traffic import GAVE_UP_STREAMING, GAVE_UP_WAITING, Outcome
from bench.load import percentile

ENGINE_COUNTERS = (
    "requests_total",
    "completed",
    "aborted",
    "rejected",
    "tokens_generated",
    "steps",
)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float
    total_ms: float


def engine_delta(
    before: Sequence[Mapping[str, float]], after: Sequence[Mapping[str, float]]
) -> dict[str, int]:
    """The engines' counters over a phase, summed over the replicas.

    Only the counters every reading has: llama.cpp counts tokens and decode
    steps but not completed or aborted requests.
    """
    names = [n for n in ENGINE_COUNTERS if all(n in r for r in (*before, *after))]
    return {
        name: int(sum(a[name] - b[name] for b, a in zip(before, after, strict=True)))
        for name in names
    }


@dataclass(slots=True)
class Phase:
    """One target at one load multiple."""

    target: str
    load: float
    rate: float
    seconds: float
    sent: int
    offered_rps: float
    achieved_rps: float
    goodput_rps: float
    good: int
    on_time: int
    #: On time but over the TTFT or total SLO.
    slo_missed: int
    rejected: int
    gave_up: int
    #: Every non-good outcome of the measured window by reason.
    reasons: dict[str, int]
    ttft_p50_ms: float
    ttft_p99_ms: float
    total_p50_ms: float
    total_p99_ms: float
    #: ``{}`` when the engines' counters before or after the phase are missing.
    engine: dict[str, int]
    mean_batch: float | None
    #: None where the engine does not count completions (llama.cpp), or a reading is missing.
    engine_rps: float | None
    wasted_completions: int | None
    wasted_tokens: int | None
    wasted_token_share: float | None
    late_send_p99_ms: float
    #: Sequences running in the engines, summed over replicas, sampled every
    #: 50 ms in the measured window (the fronts' seat use, as the engines see it).
    mean_running: float = float("nan")
    cpu_s: dict[str, float] = field(default_factory=dict)
    listen_overflows: int = 0
    #: This proxy's own count of the phase's requests by outcome (its metrics);
    #: None when its /metrics could not be read.
    front_outcomes: dict[str, int] | None = field(default_factory=dict)
    #: Readings that could not be taken, each "what: n/a (missing: reason)".
    missing: list[str] = field(default_factory=list)
    #: Goodput over this target's own goodput at 1x (set once 1x is known).
    goodput_ratio: float | None = None


def summarize(
    target: str,
    load: float,
    rate: float,
    seconds: float,
    outcomes: Sequence[Outcome],
    slo: Slo,
    engine: dict[str, int] | None,
    window: dict[str, int] | None,
) -> Phase:
    measured = [o for o in outcomes if o.measured]
    on_time = [o for o in measured if o.on_time]
    good = [o for o in on_time if _meets(o, slo)]
    reasons = Counter(o.reason for o in measured if not o.on_time)
    slo_missed = len(on_time) - len(good)
    if slo_missed:
        reasons["slo_missed"] = slo_missed
    rejected = sum(1 for o in measured if o.status >= 400)
    gave_up = reasons[GAVE_UP_WAITING] + reasons[GAVE_UP_STREAMING]
    ttfts = sorted(o.ttft_s for o in on_time if o.ttft_s is not None)
    totals = sorted(o.total_s for o in on_time if o.total_s is not None)
    all_on_time = [o for o in outcomes if o.on_time]
    delivered_tokens = sum(o.tokens for o in all_on_time)
    generated = engine["tokens_generated"] if engine is not None else None
    wasted_tokens = generated - delivered_tokens if generated is not None else None
    engine_rps = window["completed"] / seconds if window and "completed" in window else None
    return Phase(
        target=target,
        load=load,
        rate=rate,
        seconds=seconds,
        sent=len(measured),
        offered_rps=len(measured) / seconds,
        achieved_rps=len(on_time) / seconds,
        goodput_rps=len(good) / seconds,
        good=len(good),
        on_time=len(on_time),
        slo_missed=slo_missed,
        rejected=rejected,
        gave_up=gave_up,
        reasons=dict(reasons.most_common()),
        ttft_p50_ms=percentile(ttfts, 0.50) * 1000.0,
        ttft_p99_ms=percentile(ttfts, 0.99) * 1000.0,
        total_p50_ms=percentile(totals, 0.50) * 1000.0,
        total_p99_ms=percentile(totals, 0.99) * 1000.0,
        engine=engine or {},
        mean_batch=_mean_batch(window),
        engine_rps=engine_rps,
        wasted_completions=(
            engine["completed"] - len(all_on_time) if engine and "completed" in engine else None
        ),
        wasted_tokens=wasted_tokens,
        wasted_token_share=(
            None if wasted_tokens is None else wasted_tokens / generated if generated else 0.0
        ),
        late_send_p99_ms=percentile(sorted(o.late_ms for o in outcomes), 0.99),
    )


def _mean_batch(window: dict[str, int] | None) -> float | None:
    if window is None:
        return None
    return window["tokens_generated"] / window["steps"] if window["steps"] else 0.0


def _meets(outcome: Outcome, slo: Slo) -> bool:
    ttft, total = outcome.ttft_s, outcome.total_s
    return (
        ttft is not None
        and total is not None
        and ttft * 1000.0 <= slo.ttft_ms
        and total * 1000.0 <= slo.total_ms
    )


def set_ratios(phases: Iterable[Phase]) -> None:
    """Each phase's goodput over its own target's goodput at 1x."""
    phases = list(phases)
    base = {p.target: p.goodput_rps for p in phases if p.load == 1.0}
    for phase in phases:
        one = base.get(phase.target)
        phase.goodput_ratio = phase.goodput_rps / one if one else None


# -- tables -----------------------------------------------------------------------------


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.0f}"  # NaN: nothing completed


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main_table(phases: Sequence[Phase]) -> str:
    lines = [
        "| target | load | offered/s | achieved/s | goodput/s | goodput vs own 1x "
        "| rejected | gave up | TTFT p50 / p99 ms | total p50 / p99 ms "
        "| wasted completions | wasted tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        lines.append(
            f"| {p.target} | {p.load:g}x | {p.offered_rps:.1f} | {p.achieved_rps:.1f} "
            f"| {p.goodput_rps:.1f} | {_ratio(p.goodput_ratio)} "
            f"| {p.rejected} ({_share(p.rejected, p.sent)}) "
            f"| {p.gave_up} ({_share(p.gave_up, p.sent)}) "
            f"| {_ms(p.ttft_p50_ms)} / {_ms(p.ttft_p99_ms)} "
            f"| {_ms(p.total_p50_ms)} / {_ms(p.total_p99_ms)} "
            f"| {_count(p.wasted_completions)} | {_wasted_tokens(p)} |"
        )
    return "\n".join(lines)


def _count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _wasted_tokens(p: Phase) -> str:
    if p.wasted_tokens is None or p.wasted_token_share is None:
        return "n/a"
    return f"{p.wasted_tokens} ({p.wasted_token_share:.0%})"


def _num(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.2f}"


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def detail_table(phases: Sequence[Phase]) -> str:
    lines = [
        "| target | load | requests | not good, by reason | engine completed / aborted "
        "| engine completions/s, mean batch, mean running (window) | proxy counted cancelled "
        "| CPU s: front, load gen, other | send lag p99 ms |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        reasons = ", ".join(f"{name} {count}" for name, count in p.reasons.items()) or "none"
        front = p.cpu_s.get("front")
        lines.append(
            f"| {p.target} | {p.load:g}x | {p.sent} | {reasons} "
            f"| {_count(p.engine.get('completed'))} / {_count(p.engine.get('aborted'))} "
            f"| {_num(p.engine_rps)}, {_num(p.mean_batch)}, {_num(p.mean_running)} "
            f"| {_cancelled(p)} "
            f"| {'-' if front is None else f'{front:.1f}'}, {p.cpu_s.get('loadgen', 0.0):.1f}, "
            f"{p.cpu_s.get('others', 0.0):.1f} "
            f"| {p.late_send_p99_ms:.1f} |"
        )
    return "\n".join(lines)


def _cancelled(p: Phase) -> str:
    if p.front_outcomes is None:
        return "n/a"
    return str(p.front_outcomes.get("cancelled", 0)) if p.front_outcomes else "-"


def missing_report(phases: Sequence[Phase]) -> str:
    """How many readings could not be taken, and which: the figures built on them are n/a."""
    missing = [(p, m) for p in phases for m in p.missing]
    if not missing:
        return "readings missing: 0"
    lines = [f"readings missing: {len(missing)} (figures built on them are n/a)"]
    lines += [f"- {p.target} {p.load:g}x: {m}" for p, m in missing]
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Verdict:
    name: str
    value: str
    target: str
    passed: bool | None  # None: not measured

    @property
    def mark(self) -> str:
        if self.target == "(reported)":
            return "-"
        return {True: "PASS", False: "MISS", None: "NOT MEASURED"}[self.passed]


def verdicts(phases: Sequence[Phase], top: float, min_ratio: float) -> list[Verdict]:
    """The issue's three targets, on this proxy at ``top`` times capacity."""
    by = {(p.target, p.load): p for p in phases}
    proxy_top, proxy_one = by.get(("proxy", top)), by.get(("proxy", 1.0))
    haproxy_top = by.get(("haproxy", top))
    out: list[Verdict] = []
    if proxy_top is not None and proxy_one is not None and proxy_one.goodput_rps > 0:
        ratio = proxy_top.goodput_rps / proxy_one.goodput_rps
        out.append(Verdict(
            f"proxy goodput at {top:g}x / at 1x",
            f"{ratio:.3f} ({proxy_top.goodput_rps:.2f} / {proxy_one.goodput_rps:.2f} req/s)",
            f">= {min_ratio}", ratio >= min_ratio,
        ))  # fmt: skip
    if proxy_top is not None:
        if haproxy_top is None:
            out.append(Verdict(f"proxy goodput at {top:g}x / HAProxy's", "HAProxy not measured",
                               ">= 1.0", None))  # fmt: skip
        else:
            value = (
                proxy_top.goodput_rps / haproxy_top.goodput_rps
                if haproxy_top.goodput_rps
                else float("inf")
            )
            out.append(Verdict(
                f"proxy goodput at {top:g}x / HAProxy's",
                f"{value:.3f} ({proxy_top.goodput_rps:.2f} / {haproxy_top.goodput_rps:.2f} req/s)",
                ">= 1.0", value >= 1.0,
            ))  # fmt: skip
        proxy_all = [p for p in phases if p.target == "proxy"]
        counted = [p.wasted_completions for p in proxy_all if p.wasted_completions is not None]
        if len(counted) == len(proxy_all):
            wasted = sum(counted)
            per_load = ", ".join(f"{p.load:g}x: {p.wasted_completions}" for p in proxy_all)
            out.append(Verdict("proxy wasted completions (every load)", f"{wasted} ({per_load})",
                               "0", wasted == 0))  # fmt: skip
        else:  # the engine counts no completions: its generated tokens tell instead
            per_load = ", ".join(
                f"{p.load:g}x: "
                + ("n/a" if p.wasted_token_share is None else f"{p.wasted_token_share:.1%}")
                for p in proxy_all
            )
            out.append(Verdict("proxy wasted tokens, share of generated (every load)",
                               per_load, "(reported)", None))  # fmt: skip
    return out


def verdict_table(items: Sequence[Verdict]) -> str:
    lines = ["| target | value | wanted | verdict |", "|---|---|---|---|"]
    lines += [f"| {v.name} | {v.value} | {v.target} | {v.mark} |" for v in items]
    return "\n".join(lines)
