"""The staircase run: closed-loop concurrency levels until a stop line holds.

Owns ``StaircasePlan`` (what to run), ``run_staircase`` (run it) and
``StaircaseResult`` (the table and the verdict). The rules live in
``knee``; this module only sequences levels, re-runs a level that tripped a
stop line once (so a noisy level cannot decide), and stops as soon as the
rules say a stop is confirmed.

Every level sends the same input-length distribution and ``max_tokens``:
request ``i`` of every level draws its prompt length from the same seeded
generator, while the prompt's words differ per level and run, so an engine's
prefix cache cannot make later levels look faster.
"""

from __future__ import annotations

import datetime
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from proxy.loadtest.client import ENDPOINTS, build_spec, make_session
from proxy.loadtest.generator import LoopLag, run_closed_loop
from proxy.loadtest.knee import DEFAULT_RULES, KneeRules, Step, Verdict, decide, next_step
from proxy.loadtest.levels import LevelStats, summarise_level
from proxy.loadtest.progress import Progress
from proxy.loadtest.results import RequestResult, RequestSpec
from proxy.loadtest.scrape import MetricsSampler, ScrapeTarget

__all__ = [
    "DEFAULT_LEVELS",
    "StaircasePlan",
    "StaircaseResult",
    "discover_model",
    "run_staircase",
]

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32)
DEFAULT_REQUESTS_PER_LEVEL = 100
DEFAULT_MAX_TOKENS = 128
DEFAULT_INPUT_TOKENS = (128, 512)
DEFAULT_REQUEST_TIMEOUT_S = 120.0
#: A level gives up after this long, whatever its request count says.
DEFAULT_LEVEL_TIMEOUT_S = 600.0
DEFAULT_METRICS_INTERVAL_S = 0.5
#: Model name sent when the target's /v1/models cannot tell one.
FALLBACK_MODEL = "default"
#: Event-loop lag (p99) above which the report warns that the generator was busy.
LAG_WARNING_MS = 25.0


@dataclass(frozen=True, slots=True)
class StaircasePlan(ScrapeTarget):
    """Everything that shapes a staircase run; ``metrics_url`` "" turns scraping off."""

    url: str
    levels: tuple[int, ...] = DEFAULT_LEVELS
    requests_per_level: int | None = DEFAULT_REQUESTS_PER_LEVEL
    seconds_per_level: float | None = None
    warmup: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    input_tokens: tuple[int, int] = DEFAULT_INPUT_TOKENS
    endpoint: str = "chat"
    model: str | None = None
    api_key: str | None = None
    ignore_eos: bool = False
    p99_slo_ms: float | None = None
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    level_timeout_s: float = DEFAULT_LEVEL_TIMEOUT_S
    metrics_url: str | None = None
    metrics_interval_s: float = DEFAULT_METRICS_INTERVAL_S
    seed: int = 0
    rerun: bool = True

    def __post_init__(self) -> None:
        if not self.levels or any(c < 1 for c in self.levels):
            raise ValueError("levels must be positive concurrencies")
        if list(self.levels) != sorted(set(self.levels)):
            raise ValueError("levels must be strictly increasing")
        if (self.requests_per_level is None) == (self.seconds_per_level is None):
            raise ValueError("give exactly one of requests_per_level or seconds_per_level")
        if self.requests_per_level is not None and self.requests_per_level < 1:
            raise ValueError("requests_per_level must be >= 1")
        if self.seconds_per_level is not None and self.seconds_per_level <= 0:
            raise ValueError("seconds_per_level must be > 0")
        low, high = self.input_tokens
        if low < 1 or high < low:
            raise ValueError("input_tokens must be MIN:MAX with 1 <= MIN <= MAX")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}")

    def warmup_for(self, concurrency: int) -> int:
        """Requests discarded at the start of a level: by default one per worker."""
        return concurrency if self.warmup is None else self.warmup

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class StaircaseResult:
    plan: StaircasePlan
    levels: list[LevelStats]
    verdict: Verdict
    model: str
    started: str
    duration_s: float
    rules: KneeRules = DEFAULT_RULES
    idle_memory: tuple[float, str] | None = None
    notes: list[str] = field(default_factory=list)


async def discover_model(
    session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str]
) -> str | None:
    """The first model the target lists at ``/v1/models``, or None."""
    try:
        async with session.get(base_url + "/v1/models", headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                return None
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        model = data[0].get("id")
        return model if isinstance(model, str) and model else None
    return None


class _LevelCounter:
    """Live counts for the progress line of the level in progress."""

    __slots__ = ("concurrency", "done", "errors", "run", "started", "total", "warmup")

    def __init__(
        self, concurrency: int, run: int, warmup: int, total: int | None, started: float
    ) -> None:
        self.concurrency = concurrency
        self.run = run
        self.warmup = warmup
        self.total = total
        self.started = started
        self.done = 0
        self.errors = 0

    def add(self, result: RequestResult) -> None:
        self.done += 1
        if not result.ok:
            self.errors += 1

    def render(self) -> str:
        elapsed = time.perf_counter() - self.started
        rerun = " (re-run)" if self.run > 1 else ""
        head = f"level {self.concurrency}{rerun}, {elapsed:.0f} s:"
        if self.done < self.warmup:
            return f"{head} warm-up {self.done}/{self.warmup}"
        measured = self.done - self.warmup
        if self.total is not None:
            measured = min(measured, self.total)
        target = f"/{self.total}" if self.total is not None else ""
        return f"{head} {measured}{target} measured, {self.errors} errors"


def _level_line(stats: LevelStats) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    rerun = " re-run" if stats.run > 1 else ""
    errors = ", ".join(f"{k} {v}" for k, v in stats.errors.items()) or "no errors"
    return (
        f"level {stats.concurrency:>4}{rerun}: {stats.requests_per_s:7.2f} req/s "
        f"{stats.output_tokens_per_s:9.1f} tok/s  p50 {ms(stats.latency_p50_ms)} "
        f"p99 {ms(stats.latency_p99_ms)} ms  TTFT p50 {ms(stats.ttft_p50_ms)} ms  {errors}"
    )


async def run_staircase(plan: StaircasePlan, progress: Progress | None = None) -> StaircaseResult:
    """Run the levels, re-running a level that trips a stop line, until the rules stop."""
    progress = progress or Progress(None)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    zero = time.perf_counter()
    notes: list[str] = []
    levels: list[LevelStats] = []
    headers = plan.headers()
    connections = max(plan.levels) + 4
    async with make_session(connections, plan.request_timeout_s) as session:
        model = plan.model or await discover_model(session, plan.base_url, headers)
        if model is None:
            model = FALLBACK_MODEL
            notes.append(f"{plan.base_url}/v1/models named no model: sent {model!r} (use --model)")
        sampler = MetricsSampler(plan.scrape_url, zero, plan.metrics_interval_s)
        async with sampler, LoopLag() as lag, progress:
            idle = await sampler.scrape_now()
            idle_memory = None
            if idle is not None and idle.memory_ratio is not None and idle.memory_source:
                idle_memory = (idle.memory_ratio, idle.memory_source)
            rules = KneeRules(p99_slo_ms=plan.p99_slo_ms)
            if idle_memory is not None and idle_memory[0] > rules.memory_limit:
                rules = KneeRules(p99_slo_ms=plan.p99_slo_ms, memory_line=False)
            index = 0
            while index < len(plan.levels):
                concurrency = plan.levels[index]
                run = 1 + sum(1 for level in levels if level.concurrency == concurrency)
                stats = await _run_level(
                    session, plan, model, concurrency, run, zero, lag, sampler, progress
                )
                levels.append(stats)
                progress.line(_level_line(stats))
                step = next_step(levels, rules)
                if step is Step.STOP:
                    break
                if step is Step.RERUN and plan.rerun:
                    continue
                index += 1
    verdict = decide(levels, rules)
    lags = [level.loop_lag_p99_ms for level in levels if level.loop_lag_p99_ms is not None]
    if lags and max(lags) > LAG_WARNING_MS:
        notes.append(
            f"the load generator's event loop lagged up to {max(lags):.0f} ms (p99): "
            "it may have been the bottleneck; run it on another machine or core"
        )
    notes.extend(_concurrency_notes(levels))
    return StaircaseResult(
        plan=plan,
        levels=levels,
        verdict=verdict,
        model=model,
        started=started,
        duration_s=time.perf_counter() - zero,
        rules=rules,
        idle_memory=idle_memory,
        notes=notes,
    )


def _concurrency_notes(levels: list[LevelStats]) -> list[str]:
    """Levels where the generator did not keep the asked concurrency in flight."""
    short = [
        f"{level.concurrency} (achieved {level.achieved_concurrency:.1f})"
        for level in levels
        if level.achieved_concurrency is not None
        and level.error_count == 0
        and level.achieved_concurrency < 0.8 * level.concurrency
    ]
    if not short:
        return []
    return ["levels that did not keep their concurrency in flight: " + ", ".join(short)]


async def _run_level(
    session: aiohttp.ClientSession,
    plan: StaircasePlan,
    model: str,
    concurrency: int,
    run: int,
    zero: float,
    lag: LoopLag,
    sampler: MetricsSampler,
    progress: Progress,
) -> LevelStats:
    low, high = plan.input_tokens
    headers = plan.headers()

    def make_spec(index: int) -> RequestSpec:
        lengths = random.Random(f"{plan.seed}:{index}")  # same lengths at every level
        words = random.Random(f"{plan.seed}:{concurrency}:{run}:{index}")
        return build_spec(
            endpoint=plan.endpoint,
            model=model,
            input_tokens=lengths.randint(low, high),
            max_tokens=plan.max_tokens,
            rng=words,
            ignore_eos=plan.ignore_eos,
            headers=headers,
        )

    warmup = plan.warmup_for(concurrency)
    counter = _LevelCounter(concurrency, run, warmup, plan.requests_per_level, time.perf_counter())
    progress.status(counter.render)
    mark = lag.mark()
    began = time.perf_counter() - zero
    outcome = await run_closed_loop(
        session,
        plan.base_url,
        make_spec,
        concurrency=concurrency,
        warmup=warmup,
        requests=plan.requests_per_level,
        seconds=plan.seconds_per_level,
        max_duration_s=plan.level_timeout_s,
        zero=zero,
        on_result=counter.add,
    )
    progress.status(None)
    await sampler.scrape_now()
    memory = sampler.peak_memory(began, time.perf_counter() - zero)
    return summarise_level(
        concurrency,
        outcome.measured,
        outcome.window,
        run=run,
        everything=outcome.results,
        memory=memory,
        loop_lag_p99_ms=lag.p99_ms(mark),
        truncated=outcome.truncated,
    )
