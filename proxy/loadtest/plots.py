"""PNG plots of a load test: the staircase curves and the phases timeline.

Owns the drawing only (matplotlib on its Agg backend: no display, no GUI
toolkit, safe in CI and in threads). It reads finished summaries and writes
files; nothing here measures anything. matplotlib is imported inside the
functions so that ``import proxy.loadtest`` and the CLI's ``--help`` stay fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from proxy.loadtest.knee import Verdict
from proxy.loadtest.levels import LevelStats
from proxy.loadtest.schedule import PhaseWindow
from proxy.loadtest.timeline import PhasesSummary

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_staircase", "plot_timeline"]

DPI = 100
_PHASE_COLOURS = ("#e8f0fe", "#fef7e0", "#fce8e6", "#e6f4ea", "#f3e8fd")


def _use_agg() -> None:
    """Select the file-only backend before pyplot is first imported."""
    import matplotlib

    matplotlib.use("Agg", force=True)


def _first_runs(levels: Sequence[LevelStats]) -> list[LevelStats]:
    """One row per concurrency: the re-run when there is one (it is the confirmation)."""
    chosen: dict[int, LevelStats] = {}
    for level in levels:
        chosen[level.concurrency] = level
    return [chosen[c] for c in sorted(chosen)]


def _mark_verdict(ax: Axes, verdict: Verdict) -> None:
    if verdict.recommended_max_concurrency is not None:
        ax.axvline(
            verdict.recommended_max_concurrency,
            color="green",
            linestyle="--",
            label=f"recommended {verdict.recommended_max_concurrency}",
        )
    if verdict.stop is not None:
        ax.axvline(
            verdict.stop.concurrency,
            color="red",
            linestyle=":",
            label=f"stop line at {verdict.stop.concurrency}",
        )


def _finish_concurrency_plot(
    ax: Axes,
    verdict: Verdict,
    x: Sequence[int],
    title: str,
    legend: Literal["upper left", "lower right"],
) -> None:
    """The verdict's lines, a log2 concurrency axis, the title and the legend."""
    _mark_verdict(ax, verdict)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(c) for c in x])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc=legend, fontsize="small")


def _save(fig: Figure, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def plot_staircase(
    levels: Sequence[LevelStats], verdict: Verdict, latency_png: Path, throughput_png: Path
) -> None:
    """Latency (and TTFT) against concurrency; throughput against concurrency."""
    _use_agg()
    import matplotlib.pyplot as plt

    rows = _first_runs(levels)
    x = [row.concurrency for row in rows]

    fig, ax = plt.subplots(figsize=(8, 5), dpi=DPI)
    for name, label, style in (
        ("latency_p50_ms", "latency p50", "o-"),
        ("latency_p95_ms", "latency p95", "s-"),
        ("latency_p99_ms", "latency p99", "^-"),
        ("ttft_p50_ms", "TTFT p50", "o--"),
        ("ttft_p95_ms", "TTFT p95", "s--"),
    ):
        points = [(c, getattr(row, name)) for c, row in zip(x, rows, strict=True)]
        points = [(c, v) for c, v in points if v is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    ax.set_ylabel("ms")
    _finish_concurrency_plot(ax, verdict, x, "Latency against concurrency", "upper left")
    _save(fig, latency_png)

    fig, ax = plt.subplots(figsize=(8, 5), dpi=DPI)
    ax.plot(x, [row.output_tokens_per_s for row in rows], "o-", color="tab:blue")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    other = ax.twinx()
    other.plot(x, [row.requests_per_s for row in rows], "s--", color="tab:orange")
    other.set_ylabel("requests/s", color="tab:orange")
    if verdict.throughput_knee is not None:
        ax.axvline(verdict.throughput_knee, color="purple", linestyle="-.", label="throughput knee")
    _finish_concurrency_plot(ax, verdict, x, "Throughput against concurrency", "lower right")
    _save(fig, throughput_png)


def _shade_phases(ax: Axes, windows: Sequence[PhaseWindow], label: bool) -> None:
    for i, window in enumerate(windows):
        ax.axvspan(window.start_s, window.end_s, color=_PHASE_COLOURS[i % len(_PHASE_COLOURS)])
        if label:
            ax.text(
                (window.start_s + window.end_s) / 2,
                1.0,
                window.name + (" (fault)" if window.phase.fault else ""),
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize="small",
            )


def _asked_rate(windows: Sequence[PhaseWindow], t: float) -> float:
    for window in windows:
        if window.start_s <= t < window.end_s:
            return window.phase.rate_at(t - window.start_s)
    return 0.0


def plot_timeline(summary: PhasesSummary, windows: Sequence[PhaseWindow], png: Path) -> None:
    """Offered load, goodput, rejections and queue depth on one time axis, phases shaded."""
    _use_agg()
    import matplotlib.pyplot as plt

    bins = summary.timeline
    mids = [(b.start_s + b.end_s) / 2 for b in bins]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), dpi=DPI, sharex=True)
    load, shed, queue = axes
    for ax in axes:
        _shade_phases(ax, windows, label=ax is load)

    asked = [_asked_rate(windows, m) for m in mids]
    load.plot(mids, asked, color="black", linewidth=2, alpha=0.5, label="asked rate")
    load.plot(mids, [b.sent_per_s for b in bins], color="tab:gray", label="sent")
    load.plot(mids, [b.offered_per_s for b in bins], "k:", label="offered (Poisson draw)")
    load.plot(mids, [b.ok_per_s for b in bins], color="tab:blue", label="succeeded")
    load.plot(
        mids, [b.goodput_per_s for b in bins], color="tab:green", linewidth=2, label="goodput"
    )
    load.set_ylabel("requests/s")
    load.legend(loc="upper left", fontsize="small")
    load.grid(True, alpha=0.3)

    reasons = sorted({reason for b in bins for reason in b.rejections})
    if reasons:
        width = bins[0].end_s - bins[0].start_s if bins else 1.0
        series = [[b.rejections.get(r, 0) / width for b in bins] for r in reasons]
        shed.stackplot(mids, series, labels=reasons, alpha=0.8)
        shed.legend(loc="upper left", fontsize="small")
    else:
        shed.text(0.5, 0.5, "no rejections", transform=shed.transAxes, ha="center")
    retries = [(m, b.retries_per_s) for m, b in zip(mids, bins, strict=True)]
    if any(v for _, v in retries):
        shed.plot(
            [m for m, _ in retries],
            [v or 0.0 for _, v in retries],
            "k:",
            label="proxy retries",
        )
        shed.legend(loc="upper left", fontsize="small")
    shed.set_ylabel("rejected or failed /s")
    shed.grid(True, alpha=0.3)

    depth = [
        (m, b.queue_depth) for m, b in zip(mids, bins, strict=True) if b.queue_depth is not None
    ]
    if depth:
        queue.plot(
            [m for m, _ in depth], [d for _, d in depth], color="tab:red", label="queue depth (max)"
        )
    inflight = [(m, b.inflight) for m, b in zip(mids, bins, strict=True) if b.inflight is not None]
    if inflight:
        queue.plot(
            [m for m, _ in inflight],
            [v for _, v in inflight],
            color="tab:purple",
            label="in flight",
        )
    drain = summary.drain
    if drain.drain_s is not None:
        queue.axvline(drain.end_s + drain.drain_s, color="black", linestyle="--", label="drained")
    if depth or inflight:
        queue.legend(loc="upper left", fontsize="small")
    else:
        queue.text(0.5, 0.5, "no queue metrics", transform=queue.transAxes, ha="center")
    queue.set_ylabel("requests")
    queue.set_xlabel("seconds since start")
    queue.grid(True, alpha=0.3)

    _save(fig, png)
