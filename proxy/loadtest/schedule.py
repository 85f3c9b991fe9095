"""Open-loop arrival times and request picks for the phases test: pure and seeded.

Owns ``build_arrivals``: Poisson arrivals phase by phase (a ramp is a
non-homogeneous Poisson process, drawn by thinning: candidates at the phase's
peak rate, each kept with probability rate(t) / peak), and for each arrival
the tenant (by ``share``), the request class (by the tenant's ``mix``) and
the prompt length (uniform in the class's range). The same workload and seed
give the same schedule, so two runs differ only in what the target did.

No I/O and no clock here.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.loadtest.workload import Phase, Workload

__all__ = ["MAX_ARRIVALS", "Arrival", "PhaseWindow", "build_arrivals", "phase_windows"]

#: Refuse schedules beyond this many arrivals: a typo in a rate must not start a flood.
MAX_ARRIVALS = 1_000_000


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the schedule, ``at_s`` seconds after the run starts."""

    at_s: float
    phase: str
    tenant: str
    request_class: str
    input_tokens: int


@dataclass(frozen=True, slots=True)
class PhaseWindow:
    """Where a phase sits on the run's clock."""

    phase: Phase
    start_s: float
    end_s: float

    @property
    def name(self) -> str:
        return self.phase.name


def phase_windows(workload: Workload) -> list[PhaseWindow]:
    windows = []
    start = 0.0
    for phase in workload.phases:
        windows.append(PhaseWindow(phase, start, start + phase.duration_s))
        start += phase.duration_s
    return windows


def _arrival_times(window: PhaseWindow, rng: random.Random) -> list[float]:
    phase = window.phase
    peak = max(phase.rate_per_s, phase.end_rate_per_s)
    times: list[float] = []
    if peak <= 0:
        return times
    t = window.start_s
    while True:
        t += rng.expovariate(peak)
        if t >= window.end_s:
            return times
        if rng.random() * peak <= phase.rate_at(t - window.start_s):
            times.append(t)
            if len(times) > MAX_ARRIVALS:
                raise ValueError(f"phase {phase.name!r} asks for over {MAX_ARRIVALS} requests")


def _pick(rng: random.Random, names: Sequence[str], weights: Sequence[float]) -> str:
    return rng.choices(names, weights=weights, k=1)[0]


def build_arrivals(workload: Workload, seed: int | None = None) -> list[Arrival]:
    """Every arrival of the run, in time order."""
    rng = random.Random(workload.seed if seed is None else seed)
    tenants = list(workload.tenants)
    shares = [workload.tenants[name].share for name in tenants]
    arrivals: list[Arrival] = []
    for window in phase_windows(workload):
        for at in _arrival_times(window, rng):
            tenant = _pick(rng, tenants, shares)
            mix = workload.tenants[tenant].mix
            request_class = _pick(rng, list(mix), list(mix.values()))
            low, high = workload.request_classes[request_class].input_tokens
            arrivals.append(Arrival(at, window.name, tenant, request_class, rng.randint(low, high)))
        if len(arrivals) > MAX_ARRIVALS:
            raise ValueError(f"the phases ask for over {MAX_ARRIVALS} requests")
    return arrivals
