"""The phases run: open-loop Poisson traffic through the proxy, phase by phase.

Owns ``PhasesPlan`` (target, workload, fault URLs), ``run_phases`` and
``PhasesResult``. The schedule is drawn up front (``schedule``), sent on
time by the open loop (``generator``), while ``/metrics`` is scraped for
queue depth and retries (``scrape``) and a phase's fault (a simulator's,
or a real engine's through ``pause``) is switched on at its start and
restored at its end. The tables and series
come from ``timeline``.

A fault is always restored, whatever ends the run (an error, Ctrl-C): the
previous values of the fields it changed are read first and written back
in a ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy.loadtest.capacity import CapacityRow, capacity_table
from proxy.loadtest.client import build_spec, make_session
from proxy.loadtest.generator import LoopLag, run_open_loop
from proxy.loadtest.progress import Progress
from proxy.loadtest.results import RequestResult, RequestSpec
from proxy.loadtest.schedule import Arrival, PhaseWindow, build_arrivals, phase_windows
from proxy.loadtest.scrape import MetricsSample, MetricsSampler, ScrapeTarget
from proxy.loadtest.staircase import FALLBACK_MODEL, LAG_WARNING_MS, discover_model
from proxy.loadtest.target import ConfigFingerprint, identify, pool_of
from proxy.loadtest.timeline import GOOD, PhasesSummary, classify, summarise_phases
from proxy.loadtest.workload import PhaseFault, Workload

__all__ = ["PhasesPlan", "PhasesResult", "resolve_fault_url", "run_phases"]

#: Longest a fault switch (``POST /sim/faults``) may take.
FAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class PhasesPlan(ScrapeTarget):
    url: str
    workload: Workload
    workload_source: str = "<workload>"
    fault_urls: tuple[str, ...] = ()
    metrics_url: str | None = None
    #: The model (pool) every request names; None: the workload's, else discovered.
    model: str | None = None
    #: Bearer token for the proxy's admin API (its config fingerprint); None: none sent.
    admin_token: str | None = None

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}


@dataclass(slots=True)
class PhasesResult:
    base_url: str
    model: str
    workload: Workload
    workload_source: str
    started: str
    duration_s: float
    arrivals: list[Arrival]
    windows: list[PhaseWindow]
    results: list[RequestResult]
    samples: list[MetricsSample]
    summary: PhasesSummary
    loop_lag_p99_ms: float | None = None
    cpu_ratio: float | None = None
    overloaded: int = 0
    unfinished: int = 0
    generator_notes: list[str] = field(default_factory=list)
    config: ConfigFingerprint | None = None
    capacity: tuple[CapacityRow, ...] = ()


def resolve_fault_url(fault: PhaseFault, fault_urls: Sequence[str]) -> str:
    """The simulator a fault goes to: an index into ``--fault-url``, or a URL itself."""
    if isinstance(fault.target, str):
        return fault.target.rstrip("/")
    if fault.target >= len(fault_urls):
        raise ValueError(
            f"a phase's fault targets --fault-url number {fault.target} "
            f"(counting from 0), but {len(fault_urls)} were given"
        )
    return fault_urls[fault.target].rstrip("/")


async def _switch_fault(
    session: aiohttp.ClientSession, url: str, settings: Mapping[str, Any]
) -> dict[str, Any]:
    """Apply ``settings``; return the previous values of the same fields."""
    timeout = aiohttp.ClientTimeout(total=FAULT_TIMEOUT_S)
    async with session.get(url + "/sim/faults", timeout=timeout) as resp:
        resp.raise_for_status()
        current = await resp.json()
    async with session.post(url + "/sim/faults", json=dict(settings), timeout=timeout) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/sim/faults refused {dict(settings)}: {await resp.text()}")
    return {name: current.get(name) for name in settings}


async def _restore_fault(
    session: aiohttp.ClientSession, url: str, previous: Mapping[str, Any]
) -> None:
    timeout = aiohttp.ClientTimeout(total=FAULT_TIMEOUT_S)
    async with session.post(url + "/sim/faults", json=dict(previous), timeout=timeout) as resp:
        await resp.read()


async def _drive_faults(
    session: aiohttp.ClientSession,
    plan: PhasesPlan,
    windows: Sequence[PhaseWindow],
    zero: float,
    active: dict[str, dict[str, Any]],
    notes: list[str],
    progress: Progress,
) -> None:
    """Switch each phase's fault on at its start and off at its end, on the run's clock.

    A fault that cannot be switched is noted in the report and the run goes
    on: the load already sent is still worth reporting, with the caveat.
    """
    for window in windows:
        fault = window.phase.fault
        if fault is None:
            continue
        url = resolve_fault_url(fault, plan.fault_urls)
        await asyncio.sleep(max(0.0, zero + window.start_s - time.perf_counter()))
        try:
            active[url] = await _switch_fault(session, url, fault.settings())
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
            notes.append(f"fault for phase {window.name!r} not switched on at {url}: {exc}")
            continue
        progress.line(f"fault on at {url} for {window.name}: {fault.settings()}")
        await asyncio.sleep(max(0.0, zero + window.end_s - time.perf_counter()))
        previous = active[url]
        try:
            await _restore_fault(session, url, previous)
        except (aiohttp.ClientError, TimeoutError) as exc:
            notes.append(f"fault after phase {window.name!r} not restored at {url}: {exc}")
            continue  # left in `active`: tried again when the run ends
        del active[url]
        progress.line(f"fault off at {url}")


class _Tally:
    """Live counts for the progress line."""

    __slots__ = ("good", "results", "windows", "workload", "zero")

    def __init__(self, workload: Workload, windows: Sequence[PhaseWindow], zero: float) -> None:
        self.workload = workload
        self.windows = windows
        self.zero = zero
        self.results = 0
        self.good = 0

    def add(self, result: RequestResult) -> None:
        self.results += 1
        if classify(result, self.workload.slo_for(result.tenant)) == GOOD:
            self.good += 1

    def render(self, sampler: MetricsSampler) -> str:
        now = time.perf_counter() - self.zero
        window = next((w for w in self.windows if w.start_s <= now < w.end_s), None)
        where = (
            f"{window.name} {now - window.start_s:.0f}/{window.phase.duration_s:g} s"
            if window is not None
            else f"draining {now - self.windows[-1].end_s:.0f} s"
        )
        latest = sampler.latest
        depth = latest.total_depth if latest is not None else None
        queue = "-" if depth is None else f"{depth:g}"
        return f"[{where}] answered {self.results}, good {self.good}, queue {queue}"


async def run_phases(plan: PhasesPlan, progress: Progress | None = None) -> PhasesResult:
    """Run every phase of the workload against ``plan.url`` and summarise it."""
    progress = progress or Progress(None)
    workload = plan.workload
    for phase in workload.phases:
        if phase.fault is not None:
            resolve_fault_url(phase.fault, plan.fault_urls)  # fail before sending anything
    arrivals = build_arrivals(workload)
    windows = phase_windows(workload)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    notes: list[str] = []
    first_key = next((t.key() for t in workload.tenants.values() if t.key()), None)
    discover_headers = {"Authorization": f"Bearer {first_key}"} if first_key else {}
    async with make_session(workload.max_in_flight, workload.request_timeout_s) as session:
        model = (
            plan.model
            or workload.model
            or await discover_model(session, plan.base_url, discover_headers)
        )
        if model is None:
            model = FALLBACK_MODEL
            notes.append(f"{plan.base_url}/v1/models named no model: sent {model!r}")
        info = await identify(session, plan.base_url, plan.admin_headers())
        notes.extend(info.notes)
        pool, note = await pool_of(
            session, plan.base_url, info, plan.admin_headers(), model,
            plan.scrape_url, named=bool(plan.model or workload.model),
        )  # fmt: skip
        notes.extend([note] if note else [])
        specs = _spec_factory(workload, arrivals, model)
        zero = time.perf_counter()
        cpu_before = time.process_time()
        tally = _Tally(workload, windows, zero)
        sampler = MetricsSampler(plan.scrape_url, zero, workload.metrics_interval_s, pool)
        active: dict[str, dict[str, Any]] = {}
        async with sampler, LoopLag() as lag, progress:
            progress.status(lambda: tally.render(sampler))
            await sampler.scrape_now()  # counters before any load: reports use deltas
            faults = asyncio.create_task(
                _drive_faults(session, plan, windows, zero, active, notes, progress)
            )
            try:
                run = await run_open_loop(
                    session,
                    plan.base_url,
                    [a.at_s for a in arrivals],
                    specs,
                    zero=zero,
                    max_in_flight=workload.max_in_flight,
                    drain_timeout_s=workload.drain_timeout_s,
                    on_result=tally.add,
                )
            finally:
                faults.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await faults
                for url, previous in active.items():
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        await _restore_fault(session, url, previous)
            await sampler.scrape_now()
            progress.status(None)
            lag_p99 = lag.p99_ms()
    end_s = time.perf_counter() - zero
    cpu_ratio = (time.process_time() - cpu_before) / end_s if end_s > 0 else None
    if run.overloaded:
        notes.append(
            f"{run.overloaded} arrivals were not sent: over max_in_flight "
            f"({workload.max_in_flight}) requests were unanswered"
        )
    if run.unfinished:
        notes.append(f"{run.unfinished} requests were still unanswered after the drain timeout")
    if lag_p99 is not None and lag_p99 > LAG_WARNING_MS:
        notes.append(
            f"event loop lagged {lag_p99:.0f} ms (p99): the generator may be the bottleneck"
        )
    samples = list(sampler.samples)
    summary = summarise_phases(run.results, arrivals, windows, samples, workload, end_s=end_s)
    return PhasesResult(
        base_url=plan.base_url,
        model=model,
        workload=workload,
        workload_source=plan.workload_source,
        started=started,
        duration_s=end_s,
        arrivals=arrivals,
        windows=windows,
        results=run.results,
        samples=samples,
        summary=summary,
        loop_lag_p99_ms=lag_p99,
        cpu_ratio=cpu_ratio,
        overloaded=run.overloaded,
        unfinished=run.unfinished,
        generator_notes=notes,
        config=info.config,
        capacity=capacity_table(summary, windows, run.results, workload, info.config),
    )


def _spec_factory(
    workload: Workload, arrivals: Sequence[Arrival], model: str
) -> Callable[[int], RequestSpec]:
    """Request ``i``'s body, built when it is sent (bodies for a long run would not fit)."""
    keys = {name: tenant.key() for name, tenant in workload.tenants.items()}

    def make_spec(index: int) -> RequestSpec:
        arrival = arrivals[index]
        tenant = workload.tenants[arrival.tenant]
        request_class = workload.request_classes[arrival.request_class]
        headers: dict[str, str] = {}
        key = keys[arrival.tenant]
        if key:
            headers["Authorization"] = f"Bearer {key}"
        if tenant.priority:
            headers["X-Priority"] = tenant.priority
        return build_spec(
            endpoint=workload.endpoint,
            model=model,
            input_tokens=arrival.input_tokens,
            max_tokens=request_class.max_tokens,
            rng=random.Random(f"{workload.seed}:{index}"),
            stream=request_class.stream,
            headers=headers,
            tenant=arrival.tenant,
            request_class=arrival.request_class,
            phase=arrival.phase,
        )

    return make_spec
