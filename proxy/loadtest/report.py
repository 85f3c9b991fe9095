"""Report files: ``report.md`` (tables), ``report.json``, ``report.csv`` and the plots.

Owns the formatting helpers both reports share and the staircase's report,
including the ``max_concurrency`` snippet it prints (``phases_report`` owns
the phases run's). The JSON carries every figure the Markdown shows (the
staircase's ``levels``, ``throughput_knee``, ``latency_limit``,
``recommended_max_concurrency`` and ``decided_by`` at the top level, as
docs/REFERENCE.md names them), so dashboards and CI read the JSON while
people read the Markdown.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.loadtest.client import ENDPOINTS
from proxy.loadtest.knee import (
    MEMORY_FREE_MIN_BYTES,
    MEMORY_LIMIT,
    MIN_RISE,
    P99_FACTOR,
    describe_decider,
    stop_lines,
)
from proxy.loadtest.levels import LevelStats
from proxy.loadtest.plots import plot_staircase

if TYPE_CHECKING:
    from proxy.loadtest.staircase import StaircaseResult

__all__ = [
    "NO_PLOTS",
    "STAIRCASE_FILES",
    "csv_cell",
    "fmt_bytes",
    "fmt_counts",
    "fmt_ms",
    "fmt_num",
    "max_concurrency_snippet",
    "md_table",
    "plotting_available",
    "staircase_markdown",
    "write_json",
    "write_staircase_report",
]

STAIRCASE_FILES = ("report.md", "report.json", "report.csv", "latency.png", "throughput.png")


def plotting_available() -> bool:
    """matplotlib is the ``loadtest`` extra; an install without it still gets its tables."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


NO_PLOTS = "plots skipped: matplotlib is not installed (pip install 'admission-proxy[loadtest]')"


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def fmt_num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_counts(counts: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in counts.items()) or "-"


def fmt_bytes(value: float | None) -> str:
    """Bytes in GiB (MiB below one), as nvidia-smi and top count them."""
    if value is None:
        return "-"
    if value >= 1 << 30:
        return f"{value / (1 << 30):.2f} GiB"
    return f"{value / (1 << 20):.0f} MiB"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> list[str]:
    """A Markdown table; ``align`` has one letter per column: l or r."""
    marks = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return lines


def write_json(path: Path, data: object) -> None:
    def clean(value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    path.write_text(json.dumps(clean(data), indent=2) + "\n", encoding="utf-8")


# --- staircase ---------------------------------------------------------------


def max_concurrency_snippet(result: StaircaseResult) -> str:
    """A config fragment ready to paste under ``replicas:`` (docs/REFERENCE.md)."""
    verdict = result.verdict
    value = verdict.recommended_max_concurrency
    why = describe_decider(verdict.decided_by) if verdict.decided_by else ""
    comment = (
        f"staircase {result.started[:10]}: throughput knee {verdict.throughput_knee}, "
        f"latency limit {verdict.latency_limit}"
        + (f", p99 SLO limit {verdict.slo_limit}" if verdict.slo_limit is not None else "")
        + (f"; set by {why}" if why else "")
    )
    if value is None:
        return (
            "# no safe max_concurrency found: the first level already failed a stop line\n"
            f"# ({comment})"
        )
    if result.target is not None and result.target.is_proxy:
        # Through the proxy the figure is the pool's, its replicas already capped at
        # their seats: a replica entry with the proxy's url would forward to itself.
        return (
            f"# measured through the proxy (model {result.model}): {value} requests at once\n"
            "# across the replicas behind it. That is no replica's max_concurrency: run\n"
            "# the staircase against a replica's own URL for the value to put in the config.\n"
            f"# ({comment})"
        )
    return (
        "replicas:\n"
        "  - name: gpu-0                       # this replica's name in your config\n"
        f"    url: {result.plan.base_url}\n"
        f"    max_concurrency: {value}\n"
        f"    # {comment}"
    )


def _level_rows(levels: Sequence[LevelStats], result: StaircaseResult) -> list[list[str]]:
    baseline = levels[0].latency_p99_ms if levels else None
    rows = []
    for level in levels:
        lines = stop_lines(level, baseline, result.rules)
        memory = "-"
        if level.memory_ratio is not None:
            memory = f"{level.memory_ratio:.0%} {level.memory_source or ''}".strip()
        rows.append(
            [
                str(level.concurrency),
                "re-run" if level.run > 1 else "",
                fmt_num(level.achieved_concurrency),
                str(level.requests),
                fmt_num(level.requests_per_s, 2),
                fmt_num(level.output_tokens_per_s),
                fmt_ms(level.latency_p50_ms),
                fmt_ms(level.latency_p95_ms),
                fmt_ms(level.latency_p99_ms),
                fmt_ms(level.ttft_p50_ms),
                fmt_ms(level.ttft_p95_ms),
                fmt_ms(level.queue_p50_ms),
                fmt_ms(level.queue_p95_ms),
                memory,
                fmt_counts(level.errors),
                ", ".join(sorted(str(line) for line in lines)) or "-",
            ]
        )
    return rows


def staircase_markdown(result: StaircaseResult, *, plots: bool = True) -> str:
    plan, verdict = result.plan, result.verdict
    per_level = (
        f"{plan.requests_per_level} measured requests"
        if plan.requests_per_level is not None
        else f"{plan.seconds_per_level:g} measured seconds"
    )
    warmup = "one per worker" if plan.warmup is None else str(plan.warmup)
    low, high = plan.input_tokens
    queue_sources = {level.queue_source for level in result.levels if level.queue_source}
    queue_note = {
        "proxy": "the proxy's Server-Timing `queue`",
        "engine": "the engine's `x-queue-time` header",
    }
    lines = [
        "# Staircase load test",
        "",
        f"- target: {plan.base_url} (model `{result.model}`, `{ENDPOINTS[plan.endpoint]}`, "
        "streaming)",
        f"- started {result.started}, took {result.duration_s:.0f} s",
        f"- each level: closed loop, {per_level} after a warm-up of {warmup} (discarded)",
        f"- every request: input {low}-{high} tokens (uniform, the same draw at every level), "
        f"max_tokens {plan.max_tokens}" + (", ignore_eos" if plan.ignore_eos else ""),
        "- queue wait from: "
        + (
            ", ".join(queue_note.get(s, s) for s in sorted(queue_sources))
            or "nowhere (none reported)"
        ),
    ]
    if result.idle_memory is not None:
        ratio, source = result.idle_memory
        lines.append(f"- memory before load: {ratio:.0%} ({source})")
    lines += _target_lines(result)
    lines += [
        "",
        "## Result",
        "",
        f"**Recommended `max_concurrency`: {verdict.recommended_max_concurrency}**"
        + (
            f" (decided by the {describe_decider(verdict.decided_by)})"
            if verdict.decided_by
            else ""
        ),
        "",
    ]
    metric = verdict.throughput_metric.replace("_per_s", "/s").replace("_", " ")
    stop_text = "no stop line confirmed"
    if verdict.stop is not None:
        by = "a re-run" if verdict.stop.confirmed_by == "rerun" else "the next level"
        stop_text = (
            f"{', '.join(verdict.stop.lines)} at {verdict.stop.concurrency}, confirmed by {by}"
        )
    rows = [
        [
            "throughput knee",
            str(verdict.throughput_knee),
            f"last level whose {metric} rose at least {MIN_RISE:.0%} over the best before, "
            "with no errors",
        ],
        [
            "latency limit",
            str(verdict.latency_limit),
            f"last level before a stop line ({stop_text}); lines: p99 over "
            f"{P99_FACTOR:g}x the first level's, any error, memory over {MEMORY_LIMIT:.0%}",
        ],
    ]
    if plan.p99_slo_ms is not None:
        slo_stop = "no stop line confirmed"
        if verdict.slo_stop is not None:
            slo_stop = f"{', '.join(verdict.slo_stop.lines)} at {verdict.slo_stop.concurrency}"
        rows.append(
            [
                "p99 SLO limit",
                str(verdict.slo_limit),
                f"p99 within {plan.p99_slo_ms:g} ms ({slo_stop})",
            ]
        )
    lines += md_table(["", "level", "rule"], rows, "lrl")
    lines += ["", verdict.explanation, "", "```yaml", max_concurrency_snippet(result), "```", ""]
    lines += ["## Levels", ""]
    lines += md_table(
        [
            "concurrency",
            "run",
            "in flight",
            "requests",
            "req/s",
            "output tok/s",
            "p50 ms",
            "p95 ms",
            "p99 ms",
            "TTFT p50 ms",
            "TTFT p95 ms",
            "queue p50 ms",
            "queue p95 ms",
            "memory",
            "errors",
            "stop lines",
        ],
        _level_rows(result.levels, result),
        "rlrrrrrrrrrrrlll",
    )
    lines += [
        "",
        "`in flight` is the concurrency the generator actually kept (asked: `concurrency`).",
    ]
    lines += _resource_section(result)
    if verdict.noise:
        lines += ["", "## Not counted (seen once, not confirmed)", ""]
        lines += [f"- level {n.concurrency}: {', '.join(n.lines)}; {n.why}" for n in verdict.noise]
    notes = [*verdict.notes, *result.notes]
    if notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {note}" for note in notes]
    lines += ["", "## Plots", ""]
    if plots:
        lines += ["![latency](latency.png)", "", "![throughput](throughput.png)", ""]
    else:
        lines += [NO_PLOTS, ""]
    return "\n".join(lines)


def _target_lines(result: StaircaseResult) -> list[str]:
    info = result.target
    if info is None:
        return []
    kind = "the proxy" if info.is_proxy else "an engine"
    if info.simulator:
        kind += " (simulated replicas)" if info.is_proxy else " (a simulator)"
    lines = [f"- target is {kind}; cool-down between levels: {result.cool_down_s:g} s"]
    if info.config is not None:
        lines.append(f"- proxy config: {info.config.describe('seats', 'queues')}")
    return lines


def _resource_rows(levels: Sequence[LevelStats]) -> list[list[str]]:
    def cores(value: float | None) -> str:
        return "-" if value is None else f"{value * 100:.0f}%"

    rows = []
    for level in levels:
        idle = {True: "yes", False: f"no: {level.busy_at_start}", None: "-"}[level.idle_at_start]
        rows.append(
            [
                str(level.concurrency),
                "re-run" if level.run > 1 else "",
                f"{level.cool_down_s:g}",
                idle,
                cores(level.proxy_cpu),
                fmt_bytes(level.proxy_rss_bytes),
                cores(level.engine_cpu),
                fmt_bytes(level.engine_rss_bytes),
                fmt_ratio(level.gpu_utilization),
                fmt_ratio(level.gpu_memory_ratio),
                fmt_bytes(level.gpu_memory_free_bytes),
            ]
        )
    return rows


def _resource_section(result: StaircaseResult) -> list[str]:
    sources = sorted(
        {f"CPU from {level.cpu_source}" for level in result.levels if level.cpu_source}
        | {f"GPU from {level.gpu_source}" for level in result.levels if level.gpu_source}
    )
    lines = ["", "## Resources", ""]
    lines += md_table(
        [
            "concurrency", "run", "cool-down s", "idle at start", "proxy CPU", "proxy memory",
            "engine CPU", "engine memory", "GPU util", "GPU memory", "GPU free",
        ],
        _resource_rows(result.levels),
        "rlrlrrrrrrr",
    )  # fmt: skip
    lines += [
        "",
        "CPU is the processes' CPU time over the level's wall time (100% = one core busy); "
        "memory is resident memory at the level's end; GPU util is the busiest GPU's mean, "
        f"GPU memory its peak use and least free. Memory stop line: over {MEMORY_LIMIT:.0%} used "
        f"(engine KV cache or GPU memory) or under {fmt_bytes(MEMORY_FREE_MIN_BYTES)} GPU memory "
        "free. " + ("Sources: " + ", ".join(sources) + "." if sources else ""),
    ]
    if result.resource_notes:
        lines += [""] + [f"- {note}" for note in result.resource_notes]
    return lines


def _staircase_csv(path: Path, levels: Sequence[LevelStats]) -> None:
    fields = [
        "concurrency", "run", "achieved_concurrency", "requests", "ok", "error_count", "errors",
        "duration_s", "requests_per_s", "output_tokens_per_s", "latency_p50_ms",
        "latency_p95_ms", "latency_p99_ms", "ttft_p50_ms", "ttft_p95_ms", "queue_p50_ms",
        "queue_p95_ms", "queue_source", "memory_ratio", "memory_source", "loop_lag_p99_ms",
        "truncated", "proxy_cpu", "proxy_rss_bytes", "engine_cpu", "engine_rss_bytes",
        "cpu_source", "gpu_utilization", "gpu_memory_ratio", "gpu_memory_free_bytes",
        "gpu_source", "cool_down_s", "idle_at_start", "busy_at_start",
    ]  # fmt: skip
    write_csv(path, fields, (
        {**level.to_json(), "errors": ";".join(f"{k}={v}" for k, v in level.errors.items())}
        for level in levels
    ))  # fmt: skip


def write_csv(path: Path, fields: Sequence[str], rows: Iterable[Mapping[str, object]]) -> None:
    """A header, then each row's ``fields`` in order; a missing or None cell is empty."""
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({name: csv_cell(row.get(name)) for name in fields})


def csv_cell(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, float):
        return round(value, 3)
    return value


def _target_json(result: StaircaseResult) -> dict[str, object] | None:
    info = result.target
    if info is None:
        return None
    config = info.config
    return {
        "kind": info.kind,
        "simulator": info.simulator,
        "config_sha256": None if config is None else config.sha256,
        "config_summary": None if config is None else dict(config.summary),
    }


def write_staircase_report(result: StaircaseResult, out_dir: Path) -> list[Path]:
    """Write every staircase report file into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    verdict = result.verdict
    plan = result.plan
    write_json(
        out_dir / "report.json",
        {
            "kind": "staircase",
            "target": plan.base_url,
            "model": result.model,
            "started": result.started,
            "duration_s": result.duration_s,
            "plan": {
                "levels": list(plan.levels),
                "requests_per_level": plan.requests_per_level,
                "seconds_per_level": plan.seconds_per_level,
                "warmup": plan.warmup,
                "max_tokens": plan.max_tokens,
                "input_tokens": list(plan.input_tokens),
                "endpoint": ENDPOINTS[plan.endpoint],
                "ignore_eos": plan.ignore_eos,
                "p99_slo_ms": plan.p99_slo_ms,
                "seed": plan.seed,
            },
            "levels": [level.to_json() for level in result.levels],
            "throughput_knee": verdict.throughput_knee,
            "latency_limit": verdict.latency_limit,
            "recommended_max_concurrency": verdict.recommended_max_concurrency,
            "decided_by": verdict.decided_by,
            "verdict": verdict.to_json(),
            "snippet": max_concurrency_snippet(result),
            "idle_memory": None if result.idle_memory is None else list(result.idle_memory),
            "target_info": _target_json(result),
            "cool_down_s": result.cool_down_s,
            "resource_notes": list(result.resource_notes),
            "notes": [*verdict.notes, *result.notes],
        },
    )
    _staircase_csv(out_dir / "report.csv", result.levels)
    plots = plotting_available()
    if plots:
        plot_staircase(result.levels, verdict, out_dir / "latency.png", out_dir / "throughput.png")
    (out_dir / "report.md").write_text(staircase_markdown(result, plots=plots), encoding="utf-8")
    return [out_dir / name for name in STAIRCASE_FILES if plots or not name.endswith(".png")]
