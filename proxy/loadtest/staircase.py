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

import asyncio
import datetime
import functools
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import aiohttp

from proxy.loadtest.client import ENDPOINTS, build_spec, make_session
from proxy.loadtest.generator import LoopLag, run_closed_loop
from proxy.loadtest.knee import (
    DEFAULT_RULES,
    KneeRules,
    Step,
    Verdict,
    decide,
    next_step,
    stop_lines,
)
from proxy.loadtest.levels import LevelStats, summarise_level
from proxy.loadtest.progress import Progress
from proxy.loadtest.resources import LevelResources, ResourceSampler
from proxy.loadtest.results import RequestResult, RequestSpec
from proxy.loadtest.scrape import MetricsSampler, ScrapeTarget
from proxy.loadtest.target import (
    Busy,
    TargetInfo,
    identify,
    is_loopback,
    pool_of,
    read_busy,
)
from proxy.telemetry.gpu import GpuProbe

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
#: Default cool-down between levels against a real engine: the operator notes'
#: ``sleep 30``, time for the engine to finish what the last level left behind,
#: free its KV cache and let the GPU's clocks and temperature settle.
REAL_COOL_DOWN_S = 30.0
#: Default cool-down against simulators (``admission-proxy sim``), which keep no
#: cache and no heat: long enough for sequences the last level abandoned to leave
#: the batch. The idle check at each level's start reports any that did not.
SIM_COOL_DOWN_S = 1.0


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
    #: Seconds between levels; None: ``REAL_COOL_DOWN_S``, or ``SIM_COOL_DOWN_S``
    #: when the target (every replica, through the proxy) is a simulator.
    cool_down_s: float | None = None
    #: Bearer token for the proxy's admin API (state, config); None: none sent.
    admin_token: str | None = None
    #: GPU readings instead of NVML (tests); None: NVML when the target is local.
    gpu_probe: GpuProbe | None = None

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
        if self.cool_down_s is not None and self.cool_down_s < 0:
            raise ValueError("cool_down_s must be >= 0")

    def warmup_for(self, concurrency: int) -> int:
        """Requests discarded at the start of a level: by default one per worker."""
        return concurrency if self.warmup is None else self.warmup

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}


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
    target: TargetInfo | None = None
    cool_down_s: float = 0.0
    #: What could not be measured and why (GPU, CPU).
    resource_notes: list[str] = field(default_factory=list)
    idle_gpu: LevelResources | None = None


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
        info = await identify(session, plan.base_url, plan.admin_headers())
        notes.extend(info.notes)
        cool_down = _cool_down(plan, info, notes)
        pool, note = await pool_of(
            session, plan.base_url, info, plan.admin_headers(), model,
            plan.scrape_url, named=bool(plan.model),
        )  # fmt: skip
        notes.extend([note] if note else [])
        sampler = MetricsSampler(plan.scrape_url, zero, plan.metrics_interval_s, pool)
        resources = ResourceSampler(
            info,
            plan.base_url,
            plan.admin_headers(),
            plan.metrics_interval_s,
            gpu_probe=plan.gpu_probe,
            local=is_loopback(plan.base_url),
            pool=pool,
        )
        async with sampler, resources, LoopLag() as lag, progress:
            idle = await sampler.scrape_now()
            idle_memory = None
            if idle is not None and idle.memory_ratio is not None and idle.memory_source:
                idle_memory = (idle.memory_ratio, idle.memory_source)
            rules = _rules(plan, idle_memory, resources.idle_gpu())
            index = 0
            while index < len(plan.levels):
                concurrency = plan.levels[index]
                run = 1 + sum(1 for level in levels if level.concurrency == concurrency)
                waited = 0.0
                if levels and cool_down > 0:
                    text = f"cool-down {cool_down:g} s before level {concurrency}"
                    progress.status(functools.partial(str, text))
                    await asyncio.sleep(cool_down)
                    waited = cool_down
                busy = await read_busy(
                    session,
                    plan.base_url,
                    info,
                    plan.admin_headers(),
                    metrics_url=plan.scrape_url,
                    model=pool,
                )
                mark = await resources.mark()
                stats, window = await _run_level(
                    session, plan, model, concurrency, run, zero, lag, sampler, progress
                )
                used = await resources.level(mark)
                stats = _with_resources(stats, used, sampler, window, info, waited, busy)
                levels.append(stats)
                progress.line(_level_line(stats))
                refused = _refused_setup(stats)
                if refused is not None:
                    notes.append(refused)
                    break
                step = next_step(levels, rules)
                if step is Step.STOP:
                    notes.append(_stop_note(levels, rules))
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
    busy_levels = [
        f"{level.concurrency}{' (re-run)' if level.run > 1 else ''}: {level.busy_at_start}"
        for level in levels
        if level.idle_at_start is False
    ]
    if busy_levels:
        notes.append(
            "the target was not idle when these levels started (after the cool-down): "
            + "; ".join(busy_levels)
        )
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
        target=info,
        cool_down_s=cool_down,
        resource_notes=list(resources.notes),
        idle_gpu=resources.idle_gpu(),
    )


def _cool_down(plan: StaircasePlan, info: TargetInfo, notes: list[str]) -> float:
    if plan.cool_down_s is not None:
        return plan.cool_down_s
    if info.simulator:
        return SIM_COOL_DOWN_S
    notes.append(
        f"cool-down {REAL_COOL_DOWN_S:g} s between levels: the target is not (only) "
        "simulators; --cool-down sets it"
    )
    return REAL_COOL_DOWN_S


def _rules(
    plan: StaircasePlan, idle_memory: tuple[float, str] | None, idle_gpu: LevelResources | None
) -> KneeRules:
    """The knee rules, with each memory line off when it held before any load."""
    rules = KneeRules(p99_slo_ms=plan.p99_slo_ms)
    memory_line = idle_memory is None or idle_memory[0] <= rules.memory_limit
    gpu_line = idle_gpu is None or not (
        (idle_gpu.gpu_memory_ratio or 0.0) > rules.memory_limit
        or (
            idle_gpu.gpu_memory_free_bytes is not None
            and idle_gpu.gpu_memory_free_bytes < rules.memory_free_min_bytes
        )
    )
    return replace(rules, memory_line=memory_line, gpu_memory_line=gpu_line)


def _with_resources(
    stats: LevelStats,
    used: LevelResources,
    sampler: MetricsSampler,
    window: tuple[float, float],
    info: TargetInfo,
    waited: float,
    busy: Busy | None,
) -> LevelStats:
    """The level's row with its resource readings and its start state."""
    proxy_cpu, proxy_rss = used.proxy_cpu, used.proxy_rss_bytes
    engine_cpu, engine_rss = used.engine_cpu, used.engine_rss_bytes
    cpu_source = "proc" if proxy_cpu is not None or engine_cpu is not None else None
    if cpu_source is None:  # a remote target that exports its process metrics
        cpu, rss = sampler.process_cpu(*window)
        if cpu is not None:
            cpu_source = "metrics"
            if info.is_proxy:
                proxy_cpu, proxy_rss = cpu, None if rss is None else int(rss)
            else:
                engine_cpu, engine_rss = cpu, None if rss is None else int(rss)
    memory_ratio, memory_source = stats.memory_ratio, stats.memory_source
    if memory_ratio is None and used.kv_cache is not None:  # the engines behind the proxy
        memory_ratio, memory_source = used.kv_cache, "kv_cache"
    return replace(
        stats,
        memory_ratio=memory_ratio,
        memory_source=memory_source,
        proxy_cpu=proxy_cpu,
        proxy_rss_bytes=proxy_rss,
        engine_cpu=engine_cpu,
        engine_rss_bytes=engine_rss,
        cpu_source=cpu_source,
        gpu_utilization=used.gpu_utilization,
        gpu_memory_ratio=used.gpu_memory_ratio,
        gpu_memory_free_bytes=used.gpu_memory_free_bytes,
        gpu_source=used.gpu_source,
        cool_down_s=waited,
        idle_at_start=None if busy is None else busy.idle,
        busy_at_start=None if busy is None or busy.idle else busy.describe(),
    )


#: The proxy's refusals of the load test's own request (its key, model, path or body):
#: every request gets the same answer at any concurrency.
SETUP_REFUSALS = {
    "unauthenticated": "--api-key",
    "model_not_found": "--model",
    "model_not_allowed": "--model (or the key's allowed_models)",
    "priority_not_allowed": "the key's priority",
    "route_not_allowed": "--endpoint (or the proxy's routes)",
    "bad_request": "--model and --endpoint",
}


def _refused_setup(stats: LevelStats) -> str | None:
    """A note when the proxy refused every request for the load test's own setup; a
    re-run (after a cool-down) and more levels would only repeat it."""
    if stats.ok or not stats.errors or not set(stats.errors) <= SETUP_REFUSALS.keys():
        return None
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(stats.errors.items()))
    fixes = " and ".join(dict.fromkeys(SETUP_REFUSALS[reason] for reason in sorted(stats.errors)))
    return (
        f"stopped after level {stats.concurrency}: the target refused every request "
        f"({reasons}), which says nothing of its capacity: check {fixes}"
    )


def _stop_note(levels: list[LevelStats], rules: KneeRules) -> str:
    """Why the staircase stopped, with the readings that crossed the line."""
    last = levels[-1]
    baseline = levels[0].latency_p99_ms
    lines = sorted(str(line) for line in stop_lines(last, baseline, rules))
    facts: list[str] = []
    if last.error_count:
        facts.append(f"{last.error_count} errors")
    if last.latency_p99_ms is not None and baseline is not None:
        facts.append(f"p99 {last.latency_p99_ms:.0f} ms vs {baseline:.0f} ms at the first level")
    if last.memory_ratio is not None:
        facts.append(f"{last.memory_source or 'memory'} {last.memory_ratio:.0%}")
    if last.gpu_memory_ratio is not None:
        free = (last.gpu_memory_free_bytes or 0) / (1 << 30)
        facts.append(
            f"GPU memory {last.gpu_memory_ratio:.0%} used, {free:.2f} GiB free ({last.gpu_source})"
        )
    rerun = " (re-run)" if last.run > 1 else ""
    return (
        f"stopped after level {last.concurrency}{rerun}: stop line confirmed "
        f"({', '.join(lines) or 'see the table'}); {'; '.join(facts)}"
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
) -> tuple[LevelStats, tuple[float, float]]:
    """The level's row, and its span on the run's clock (for the scraped readings)."""
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
    ended = time.perf_counter() - zero
    memory = sampler.peak_memory(began, ended)
    stats = summarise_level(
        concurrency,
        outcome.measured,
        outcome.window,
        run=run,
        everything=outcome.results,
        memory=memory,
        loop_lag_p99_ms=lag.p99_ms(mark),
        truncated=outcome.truncated,
    )
    return stats, (began, ended)
