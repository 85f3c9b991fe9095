"""Knee detection on hand-written staircase tables: no sockets, no clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from proxy.loadtest.knee import (
    KneeRules,
    Step,
    StopLine,
    decide,
    next_step,
    stop_lines,
    throughput_knee,
)
from proxy.loadtest.levels import LevelStats

LEVELS = (1, 2, 4, 8, 16, 32)


def row(
    concurrency: int,
    tokens_per_s: float,
    p99_ms: float,
    *,
    run: int = 1,
    errors: int = 0,
    memory: float | None = None,
) -> LevelStats:
    """One measured run: ``tokens_per_s`` throughput, ``p99_ms`` latency."""
    return LevelStats(
        concurrency=concurrency,
        run=run,
        requests=100,
        ok=100 - errors,
        errors={"http_503": errors} if errors else {},
        requests_per_s=tokens_per_s / 100,
        output_tokens_per_s=tokens_per_s,
        latency_p50_ms=p99_ms * 0.8,
        latency_p99_ms=p99_ms,
        memory_ratio=memory,
        memory_source=None if memory is None else "kv_cache",
    )


def table(
    tput: tuple[float, ...], p99: tuple[float, ...], levels: tuple[int, ...] = LEVELS
) -> list[LevelStats]:
    return [row(c, t, p) for c, t, p in zip(levels, tput, p99, strict=True)]


# A replica with 8 slots: throughput rises to 8 then flattens, latency doubles past it.
RISE_THEN_FLAT = (100.0, 190.0, 350.0, 600.0, 620.0, 625.0)
P99_KNEE_AT_8 = (100.0, 105.0, 115.0, 140.0, 260.0, 520.0)


def test_clean_staircase_with_rerun_confirmation() -> None:
    """Throughput flattens after 8 and p99 doubles at 16 (and again on its re-run): 8."""
    levels = table(RISE_THEN_FLAT[:5], P99_KNEE_AT_8[:5], LEVELS[:5])
    levels.append(row(16, 618.0, 255.0, run=2))
    verdict = decide(levels)
    assert verdict.throughput_knee == 8
    assert verdict.latency_limit == 8
    assert verdict.recommended_max_concurrency == 8
    assert verdict.decided_by == "throughput_knee+latency_limit"
    assert verdict.stop is not None
    assert verdict.stop.concurrency == 16
    assert verdict.stop.lines == (StopLine.P99,)
    assert verdict.stop.confirmed_by == "rerun"
    assert verdict.noise == ()


def test_p99_line_confirmed_by_the_next_level() -> None:
    """Without re-runs, p99 over twice the first level's at 16 and at 32 stops at 16."""
    verdict = decide(table(RISE_THEN_FLAT, P99_KNEE_AT_8))
    assert verdict.stop is not None
    assert (verdict.stop.concurrency, verdict.stop.confirmed_by) == (16, "next_level")
    assert verdict.latency_limit == 8
    assert verdict.recommended_max_concurrency == 8


def test_error_line_stops_and_bars_the_level_from_the_knee() -> None:
    """Errors at 8 on both runs: the latency limit is 4, and 8 cannot be the knee."""
    levels = table(RISE_THEN_FLAT[:3], P99_KNEE_AT_8[:3], LEVELS[:3])
    levels += [row(8, 600.0, 140.0, errors=3), row(8, 590.0, 150.0, errors=1, run=2)]
    verdict = decide(levels)
    assert verdict.stop is not None
    assert verdict.stop.lines == (StopLine.ERRORS,)
    assert verdict.latency_limit == 4
    assert verdict.throughput_knee == 4
    assert verdict.recommended_max_concurrency == 4


def test_memory_line_stops_at_two_consecutive_levels() -> None:
    """KV cache over 90% at 8 and at 16: the latency limit is 4."""
    levels = table(RISE_THEN_FLAT[:3], P99_KNEE_AT_8[:3], LEVELS[:3])
    levels += [row(8, 600.0, 140.0, memory=0.93), row(16, 620.0, 150.0, memory=0.97)]
    verdict = decide(levels)
    assert verdict.stop is not None
    assert verdict.stop.lines == (StopLine.MEMORY,)
    assert verdict.latency_limit == 4
    assert verdict.recommended_max_concurrency == 4
    assert verdict.decided_by == "latency_limit"


def test_memory_line_can_be_switched_off() -> None:
    """A preallocating engine (memory high before load): memory never stops the run."""
    levels = [row(c, t, 100.0, memory=0.95) for c, t in zip(LEVELS, RISE_THEN_FLAT, strict=True)]
    rules = KneeRules(memory_line=False)
    assert StopLine.MEMORY not in stop_lines(levels[3], 100.0, rules)
    verdict = decide(levels, rules)
    assert verdict.stop is None
    assert verdict.recommended_max_concurrency == 8


def test_no_stop_line_at_all() -> None:
    """Every level rises and stays fast: both limits are the highest level, with a note."""
    tput = (100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0)
    verdict = decide(table(tput, (100.0,) * 6))
    assert verdict.stop is None
    assert verdict.throughput_knee == 32
    assert verdict.latency_limit == 32
    assert verdict.recommended_max_concurrency == 32
    assert any("no stop line confirmed" in note for note in verdict.notes)


def test_noisy_single_level_is_not_counted_when_its_rerun_is_clean() -> None:
    """A p99 spike at 4, gone on its re-run, does not stop anything."""
    levels = table(RISE_THEN_FLAT[:3], (100.0, 105.0, 400.0), LEVELS[:3])
    levels.append(row(4, 355.0, 118.0, run=2))
    levels += table(RISE_THEN_FLAT[3:], P99_KNEE_AT_8[3:], LEVELS[3:])
    verdict = decide(levels)
    assert [n.concurrency for n in verdict.noise] == [4]
    assert verdict.noise[0].lines == (StopLine.P99,)
    assert verdict.latency_limit == 8
    assert verdict.recommended_max_concurrency == 8


def test_noisy_single_error_is_not_counted_when_the_next_level_is_clean() -> None:
    """One error at 2, none at 4: not a stop line; but 2 cannot be the knee."""
    levels = table(RISE_THEN_FLAT, P99_KNEE_AT_8)
    levels[1] = row(2, 190.0, 105.0, errors=1)
    verdict = decide(levels)
    assert [(n.concurrency, n.lines) for n in verdict.noise] == [(2, (StopLine.ERRORS,))]
    assert verdict.latency_limit == 8
    assert verdict.throughput_knee == 8


def test_unconfirmed_trip_on_the_last_level_does_not_count() -> None:
    """p99 doubles only at the last level and it was not re-run: noted, not a stop."""
    levels = table(RISE_THEN_FLAT, (100.0, 105.0, 115.0, 140.0, 150.0, 260.0))
    verdict = decide(levels)
    assert verdict.stop is None
    assert [n.concurrency for n in verdict.noise] == [32]
    assert verdict.latency_limit == 32
    assert verdict.recommended_max_concurrency == 8  # the throughput knee decides


def test_throughput_knee_decides_when_lower() -> None:
    """Throughput flat after 4, latency fine throughout: recommended 4, by the knee."""
    tput = (100.0, 190.0, 350.0, 370.0, 375.0, 380.0)
    verdict = decide(table(tput, (100.0,) * 6))
    assert verdict.throughput_knee == 4
    assert verdict.recommended_max_concurrency == 4
    assert verdict.decided_by == "throughput_knee"


def test_latency_limit_decides_when_lower() -> None:
    """Throughput still rises at 16 but p99 doubles from 8 on: recommended 4."""
    tput = (100.0, 200.0, 400.0, 800.0, 1600.0)
    p99 = (100.0, 110.0, 150.0, 250.0, 400.0)
    verdict = decide(table(tput, p99, LEVELS[:5]))
    assert verdict.throughput_knee == 16
    assert verdict.latency_limit == 4
    assert verdict.recommended_max_concurrency == 4
    assert verdict.decided_by == "latency_limit"


def test_dip_then_recovery_is_not_growth() -> None:
    """Rising 10% over a dipped level is not rising over the best before it."""
    levels = table((100.0, 200.0, 170.0, 205.0), (100.0,) * 4, LEVELS[:4])
    assert throughput_knee(levels) == (2, "output_tokens_per_s")


def test_requests_per_second_when_tokens_are_not_counted() -> None:
    """Non-streaming targets without usage: the knee is read from requests/s."""
    levels = [
        LevelStats(concurrency=c, ok=10, requests=10, requests_per_s=r)
        for c, r in ((1, 5.0), (2, 9.0), (4, 9.5))
    ]
    assert throughput_knee(levels) == (2, "requests_per_s")


def test_p99_slo_picks_the_last_level_within_it() -> None:
    """With a 150 ms SLO, 16 and 32 are over it: the SLO sets the recommendation, 8."""
    p99 = (100.0, 110.0, 130.0, 145.0, 180.0, 210.0)
    verdict = decide(table(RISE_THEN_FLAT, p99), KneeRules(p99_slo_ms=150.0))
    assert verdict.slo_limit == 8
    assert verdict.recommended_max_concurrency == 8
    assert verdict.decided_by == "p99_slo"
    assert verdict.stop is None  # p99 never doubled: the default lines held throughout


def test_p99_slo_can_recommend_above_the_doubling_line() -> None:
    """A generous SLO replaces the doubling rule: recommended 16, not 8."""
    levels = [*table(RISE_THEN_FLAT, P99_KNEE_AT_8), row(32, 624.0, 510.0, run=2)]
    verdict = decide(levels, KneeRules(p99_slo_ms=300.0))
    assert verdict.latency_limit == 8
    assert verdict.slo_limit == 16
    assert verdict.recommended_max_concurrency == 16


def test_first_level_failing_recommends_nothing() -> None:
    """Errors at concurrency 1 on both runs: no safe level."""
    levels = [row(1, 0.0, 100.0, errors=100), row(1, 0.0, 100.0, errors=100, run=2)]
    verdict = decide(levels)
    assert verdict.latency_limit is None
    assert verdict.recommended_max_concurrency is None
    assert verdict.decided_by is None


@pytest.mark.parametrize(
    ("levels", "expected"),
    [
        pytest.param([row(1, 100.0, 100.0)], Step.NEXT, id="clean"),
        pytest.param([row(1, 100.0, 100.0), row(2, 150.0, 300.0)], Step.RERUN, id="first-trip"),
        pytest.param(
            [row(1, 100.0, 100.0), row(2, 150.0, 300.0), row(2, 150.0, 110.0, run=2)],
            Step.NEXT,
            id="rerun-clean",
        ),
        pytest.param(
            [row(1, 100.0, 100.0), row(2, 150.0, 300.0), row(2, 150.0, 290.0, run=2)],
            Step.STOP,
            id="rerun-confirms",
        ),
        pytest.param(
            [row(1, 100.0, 100.0), row(2, 150.0, 300.0), row(2, 150.0, 110.0, errors=1, run=2)],
            Step.NEXT,
            id="rerun-other-line",
        ),
    ],
)
def test_next_step(levels: list[LevelStats], expected: Step) -> None:
    """The runner re-runs a first trip, stops on confirmation, otherwise goes on."""
    assert next_step(levels) is expected


def test_next_step_with_slo_goes_on_until_both_line_sets_stop() -> None:
    """The doubling line confirmed at 16 but the SLO still met: keep climbing."""
    levels = table(RISE_THEN_FLAT[:5], P99_KNEE_AT_8[:5], LEVELS[:5])
    levels.append(row(16, 618.0, 255.0, run=2))
    assert next_step(levels) is Step.STOP
    assert next_step(levels, KneeRules(p99_slo_ms=1000.0)) is Step.NEXT


@pytest.mark.parametrize(
    ("ratio", "free_gib", "gpu_line", "expected"),
    [
        (0.50, 40.0, True, set()),
        (0.95, 4.0, True, {StopLine.MEMORY}),  # over 90% used, plenty free (a big GPU)
        (0.80, 0.5, True, {StopLine.MEMORY_FREE}),  # under 1 GiB free (a small GPU)
        (0.97, 0.2, True, {StopLine.MEMORY, StopLine.MEMORY_FREE}),
        (0.97, 0.2, False, set()),  # GPU lines off: over the line before any load
    ],
)
def test_gpu_memory_lines(
    ratio: float, free_gib: float, gpu_line: bool, expected: set[StopLine]
) -> None:
    """GPU memory: over 90% used or under 1 GiB free is a stop line, each its own."""
    level = replace(
        row(1, 100, 100),
        gpu_memory_ratio=ratio,
        gpu_memory_free_bytes=int(free_gib * (1 << 30)),
    )
    assert set(stop_lines(level, 100, KneeRules(gpu_memory_line=gpu_line))) == expected


def test_memory_free_line_confirmed_by_rerun_stops_and_says_so() -> None:
    """Under 1 GiB free at level 4 and again on its re-run: the latency limit is 2."""
    levels = [row(1, 100, 100), row(2, 190, 110)]
    levels += [
        replace(row(4, 300, 120, run=run), gpu_memory_ratio=0.85, gpu_memory_free_bytes=500 << 20)
        for run in (1, 2)
    ]
    assert next_step(levels) is Step.STOP
    verdict = decide(levels)
    assert verdict.latency_limit == 2
    assert verdict.stop is not None and verdict.stop.lines == (StopLine.MEMORY_FREE,)
    assert "memory_under_1gb_free at 4" in verdict.explanation
