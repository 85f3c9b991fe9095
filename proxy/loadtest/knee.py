"""The staircase's stop lines and knee rules (docs/REFERENCE.md): pure functions.

Input is a level table: ``LevelStats`` rows in the order they ran, where a
level that tripped a stop line may appear twice (``run`` 1, then its re-run
``run`` 2). No I/O and no clock here, so every rule is tested on hand-written
tables.

- **Stop lines** (the operator notes' stop lines): p99 latency over twice the
  first level's p99, any error, memory over 90% (engine KV cache or GPU
  memory) or under 1 GiB of GPU memory free. With ``--p99-slo-ms`` a
  second line set replaces the doubling rule with "p99 over the SLO".
- **Confirmation**: a stop line counts only when it holds at two consecutive
  levels or on a re-run of the level, so one noisy level never decides. The
  same line must hold both times.
- **Latency limit**: the last level before the first confirmed stop; the
  highest level run when no stop was confirmed; None when the first level
  itself is past a confirmed stop line.
- **Throughput knee**: the last level whose throughput rose at least 10% over
  the level before, with no errors. "The level before" is read as the best
  level before, so a dip followed by a recovery to the old plateau is not
  mistaken for growth.
- **Recommendation**: the smaller of the two, or with an SLO the last level
  before the SLO line; ``decided_by`` says which rule set it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from proxy.loadtest.levels import LevelStats

__all__ = [
    "DEFAULT_LINES",
    "DEFAULT_RULES",
    "MEMORY_FREE_MIN_BYTES",
    "MEMORY_LIMIT",
    "MIN_RISE",
    "P99_FACTOR",
    "SLO_LINES",
    "KneeRules",
    "Noise",
    "Step",
    "Stop",
    "StopLine",
    "Verdict",
    "decide",
    "describe_decider",
    "find_stop",
    "next_step",
    "stop_lines",
    "throughput_knee",
]

#: p99 above this multiple of the first level's p99 is a stop line.
P99_FACTOR = 2.0
#: Memory (engine KV cache, else GPU memory) above this ratio is a stop line.
MEMORY_LIMIT = 0.90
#: GPU memory free below this (1 GiB, as nvidia-smi counts) is a stop line.
MEMORY_FREE_MIN_BYTES = 1 << 30
#: A level is still "rising" when its throughput is at least this much above the best before.
MIN_RISE = 0.10


@dataclass(frozen=True, slots=True)
class KneeRules:
    """The thresholds, and the operator's switches: an SLO, and the memory line.

    ``memory_line`` (engine KV cache) and ``gpu_memory_line`` (GPU memory
    used and free) are off when that memory was already over the line before
    any load (an engine that preallocates, as vLLM does with 90% of the GPU):
    the line would then trip at every level and say nothing about concurrency.
    """

    p99_slo_ms: float | None = None
    memory_line: bool = True
    gpu_memory_line: bool = True
    p99_factor: float = P99_FACTOR
    memory_limit: float = MEMORY_LIMIT
    memory_free_min_bytes: int = MEMORY_FREE_MIN_BYTES
    min_rise: float = MIN_RISE


DEFAULT_RULES = KneeRules()


class StopLine(StrEnum):
    P99 = "p99_over_2x_first"
    P99_SLO = "p99_over_slo"
    ERRORS = "errors"
    MEMORY = "memory_over_90pct"
    MEMORY_FREE = "memory_under_1gb_free"


DEFAULT_LINES = frozenset({StopLine.P99, StopLine.ERRORS, StopLine.MEMORY, StopLine.MEMORY_FREE})
SLO_LINES = frozenset({StopLine.P99_SLO, StopLine.ERRORS, StopLine.MEMORY, StopLine.MEMORY_FREE})


class Step(StrEnum):
    """What the runner does after a level: go on, measure it again, or stop."""

    NEXT = "next"
    RERUN = "rerun"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class Stop:
    """A stop line confirmed at ``concurrency`` (by a re-run or by the next level)."""

    concurrency: int
    lines: tuple[StopLine, ...]
    confirmed_by: str

    def to_json(self) -> dict[str, object]:
        return {
            "concurrency": self.concurrency,
            "lines": [str(line) for line in self.lines],
            "confirmed_by": self.confirmed_by,
        }


@dataclass(frozen=True, slots=True)
class Noise:
    """A stop line seen once at ``concurrency`` and not confirmed: it did not count."""

    concurrency: int
    lines: tuple[StopLine, ...]
    why: str

    def to_json(self) -> dict[str, object]:
        return {
            "concurrency": self.concurrency,
            "lines": [str(line) for line in self.lines],
            "why": self.why,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    """Everything the staircase concludes from its table."""

    throughput_knee: int | None
    latency_limit: int | None
    recommended_max_concurrency: int | None
    decided_by: str | None
    throughput_metric: str
    stop: Stop | None = None
    slo_limit: int | None = None
    slo_stop: Stop | None = None
    noise: tuple[Noise, ...] = ()
    explanation: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, object]:
        return {
            "throughput_knee": self.throughput_knee,
            "latency_limit": self.latency_limit,
            "recommended_max_concurrency": self.recommended_max_concurrency,
            "decided_by": self.decided_by,
            "throughput_metric": self.throughput_metric,
            "stop": None if self.stop is None else self.stop.to_json(),
            "slo_limit": self.slo_limit,
            "slo_stop": None if self.slo_stop is None else self.slo_stop.to_json(),
            "noise": [n.to_json() for n in self.noise],
            "explanation": self.explanation,
            "notes": list(self.notes),
        }


def stop_lines(
    level: LevelStats, baseline_p99_ms: float | None, rules: KneeRules = DEFAULT_RULES
) -> frozenset[StopLine]:
    """Every stop line that holds for one measured run."""
    lines: set[StopLine] = set()
    p99 = level.latency_p99_ms
    doubled = None if baseline_p99_ms is None else rules.p99_factor * baseline_p99_ms
    if p99 is not None and doubled is not None and p99 > doubled:
        lines.add(StopLine.P99)
    if p99 is not None and rules.p99_slo_ms is not None and p99 > rules.p99_slo_ms:
        lines.add(StopLine.P99_SLO)
    if level.error_count > 0:
        lines.add(StopLine.ERRORS)
    memory = level.memory_ratio
    if rules.memory_line and memory is not None and memory > rules.memory_limit:
        lines.add(StopLine.MEMORY)
    if rules.gpu_memory_line:
        gpu = level.gpu_memory_ratio
        if gpu is not None and gpu > rules.memory_limit:
            lines.add(StopLine.MEMORY)
        free = level.gpu_memory_free_bytes
        if free is not None and free < rules.memory_free_min_bytes:
            lines.add(StopLine.MEMORY_FREE)
    return frozenset(lines)


def _baseline(levels: Sequence[LevelStats]) -> float | None:
    return levels[0].latency_p99_ms if levels else None


def _runs_by_level(levels: Sequence[LevelStats]) -> list[tuple[int, list[LevelStats]]]:
    """Runs grouped by concurrency, levels in the order they first ran."""
    groups: dict[int, list[LevelStats]] = {}
    for level in levels:
        groups.setdefault(level.concurrency, []).append(level)
    return list(groups.items())


def _ordered(lines: Iterable[StopLine]) -> tuple[StopLine, ...]:
    return tuple(sorted(lines, key=str))


def find_stop(
    levels: Sequence[LevelStats],
    considered: frozenset[StopLine] = DEFAULT_LINES,
    rules: KneeRules = DEFAULT_RULES,
) -> tuple[Stop | None, int | None, tuple[Noise, ...]]:
    """The first confirmed stop, the limit it sets, and the trips that did not count."""
    baseline = _baseline(levels)
    grouped = _runs_by_level(levels)
    noise: list[Noise] = []

    def lines(level: LevelStats) -> frozenset[StopLine]:
        return stop_lines(level, baseline, rules) & considered

    for i, (concurrency, runs) in enumerate(grouped):
        first = lines(runs[0])
        if not first:
            continue
        if len(runs) > 1:
            held = first & lines(runs[1])
            confirmed_by, why = "rerun", "its re-run did not show it again"
        elif i + 1 < len(grouped):
            held = first & lines(grouped[i + 1][1][0])
            confirmed_by, why = "next_level", "the next level did not show it again"
        else:
            held = frozenset()
            confirmed_by, why = "", "last level run, not re-run"
        if held:
            limit = grouped[i - 1][0] if i > 0 else None
            return Stop(concurrency, _ordered(held), confirmed_by), limit, tuple(noise)
        noise.append(Noise(concurrency, _ordered(first), why))
    limit = grouped[-1][0] if grouped else None
    return None, limit, tuple(noise)


def _throughput_metric(levels: Sequence[LevelStats]) -> str:
    """Output tokens/s when every level that served anything counted tokens, else req/s."""
    served = [level for level in levels if level.ok > 0]
    if served and all(level.output_tokens_per_s > 0 for level in served):
        return "output_tokens_per_s"
    return "requests_per_s"


def throughput_knee(
    levels: Sequence[LevelStats], rules: KneeRules = DEFAULT_RULES
) -> tuple[int | None, str]:
    """The last level that rose ``min_rise`` over the best before it, error-free."""
    metric = _throughput_metric(levels)
    knee: int | None = None
    best: float | None = None
    for concurrency, runs in _runs_by_level(levels):
        level = runs[-1]  # a re-run is the confirming measurement
        value = float(getattr(level, metric))
        rising = best is None or value >= best * (1.0 + rules.min_rise)
        if rising and level.error_count == 0 and level.ok > 0:
            knee = concurrency
        best = value if best is None else max(best, value)
    return knee, metric


def next_step(levels: Sequence[LevelStats], rules: KneeRules = DEFAULT_RULES) -> Step:
    """After the last row: stop (every line set confirmed), re-run it, or go on.

    A run that trips a line not yet confirmed is re-run once at the same
    concurrency rather than confirmed at the next, higher one: pushing twice
    the load onto a replica that already erred or ran out of memory is what
    the stop lines exist to avoid.
    """
    if not levels:
        return Step.NEXT
    line_sets = [DEFAULT_LINES] if rules.p99_slo_ms is None else [DEFAULT_LINES, SLO_LINES]
    open_sets = [s for s in line_sets if find_stop(levels, s, rules)[0] is None]
    if not open_sets:
        return Step.STOP
    last = levels[-1]
    considered = frozenset().union(*open_sets)
    tripped = stop_lines(last, _baseline(levels), rules) & considered
    if tripped and last.run == 1:
        return Step.RERUN
    return Step.NEXT


def _describe_stop(stop: Stop | None, limit: int | None) -> str:
    if stop is None:
        return f"no stop line confirmed up to {limit}"
    lines = ", ".join(str(line) for line in stop.lines)
    by = "a re-run" if stop.confirmed_by == "rerun" else "the next level"
    return f"{lines} at {stop.concurrency}, confirmed by {by}"


def describe_decider(decided_by: str) -> str:
    """``throughput_knee+latency_limit`` as words: ``throughput knee and latency limit``."""
    return decided_by.replace("+", " and ").replace("_", " ").replace("p99 slo", "p99 SLO")


def decide(levels: Sequence[LevelStats], rules: KneeRules = DEFAULT_RULES) -> Verdict:
    """Knee, latency limit and the recommended ``max_concurrency`` for a level table."""
    knee, metric = throughput_knee(levels, rules)
    stop, limit, noise = find_stop(levels, DEFAULT_LINES, rules)
    notes: list[str] = []
    if stop is None and levels:
        notes.append(
            f"no stop line confirmed: the latency limit is only the highest level run ({limit})"
        )
    knee_text = (
        f"throughput knee {knee}" if knee is not None else "no error-free level rose in throughput"
    )
    slo_limit: int | None = None
    slo_stop: Stop | None = None
    if not rules.memory_line:
        notes.append("memory line off: memory was over the limit before any load")
    if not rules.gpu_memory_line:
        notes.append(
            "GPU memory lines off: GPU memory was over 90% used or under 1 GiB free before any load"
        )
    p99_slo_ms = rules.p99_slo_ms
    if p99_slo_ms is not None:
        slo_stop, slo_limit, slo_noise = find_stop(levels, SLO_LINES, rules)
        noise = tuple(dict.fromkeys((*noise, *slo_noise)))
        recommended = slo_limit
        decided_by: str | None = "p99_slo" if slo_limit is not None else None
        explanation = (
            f"p99 SLO {p99_slo_ms:g} ms: {_describe_stop(slo_stop, slo_limit)}; "
            f"recommended {recommended}"
        )
    else:
        candidates = {"throughput_knee": knee, "latency_limit": limit}
        present = {name: value for name, value in candidates.items() if value is not None}
        if limit is None or not present:
            recommended, decided_by = None, None
        else:
            recommended = min(present.values())
            decided_by = "+".join(name for name, value in present.items() if value == recommended)
        explanation = (
            f"{knee_text}; latency limit {limit} ({_describe_stop(stop, limit)}); "
            f"recommended {recommended}"
            + (f", set by the {describe_decider(decided_by)}" if decided_by else "")
        )
    if recommended is None and levels:
        notes.append("no level is safe to recommend: the first level already failed a stop line")
    return Verdict(
        throughput_knee=knee,
        latency_limit=limit,
        recommended_max_concurrency=recommended,
        decided_by=decided_by,
        throughput_metric=metric,
        stop=stop,
        slo_limit=slo_limit,
        slo_stop=slo_stop,
        noise=noise,
        explanation=explanation,
        notes=tuple(notes),
    )
