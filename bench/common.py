"""Small helpers every benchmark uses: what was measured, on what, and JSON-safe numbers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
#: Environment prefixes removed from child processes' environment: config
#: overrides and OpenTelemetry exporters would change what is measured.
SCRUBBED_ENV = ("ADMISSION_", "OTEL_")


def scrubbed_env() -> dict[str, str]:
    """This process's environment without ``SCRUBBED_ENV`` variables, for child servers."""
    return {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_ENV)}


def own_cpu() -> float:
    """User plus system CPU seconds of this process (the load generator)."""
    times = os.times()
    return times.user + times.system


#: CPU flags that change how fast an inference engine or the proxy runs: the
#: vector and matrix extensions llama.cpp's kernels choose between.
NOTABLE_CPU_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "sse4_2", "neon", "asimd",
)  # fmt: skip
CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_field(names: tuple[str, ...], cpuinfo: Path) -> str | None:
    """The first ``name : value`` line of ``/proc/cpuinfo`` among ``names``."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in names:
            return value.strip()
    return None


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name, so figures from different machines are told apart."""
    return _cpuinfo_field(("model name", "Model", "cpu model"), cpuinfo) or (
        platform.processor() or platform.machine() or "unknown"
    )


def cpu_flags(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """The notable CPU flags present, and a short hash of the whole flag list
    (two machines with the same hash run the same kernels)."""
    flags = (_cpuinfo_field(("flags", "Features"), cpuinfo) or "").split()
    return {
        "notable": [f for f in NOTABLE_CPU_FLAGS if f in flags],
        "all_sha256_12": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
        if flags
        else None,
    }


def cpu_line() -> str:
    """One line for a report's header: model, notable flags and CPU count."""
    flags = cpu_flags()
    notable = " ".join(flags["notable"]) or "none of the notable flags"
    return f"CPU: {cpu_model()} ({os.cpu_count()} CPUs; {notable}; flags {flags['all_sha256_12']})"


def machine(note: str) -> dict[str, Any]:
    """The machine and library versions a result was measured with."""
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "uvloop": metadata.version("uvloop"),
        "note": note,
    }


def access_log_requests(text: str) -> Iterator[dict[str, Any]]:
    """The request lines of a proxy's JSON access log; other lines and noise are skipped."""
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "request":
            yield event


def revision() -> str:
    """The commit measured, with ``+dirty`` when ``proxy/`` has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "proxy"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


@dataclass(slots=True)
class FigureBase:
    """One line of a benchmark's verdict table; each report adds how it prints."""

    name: str
    value: float
    target: str
    #: None: reported for context, no target applies.
    passed: bool | None


class RoundRun(Protocol):
    """One measured run of one target in one round: what ``summarize_rounds`` groups by."""

    target: str
    round: int


RunT = TypeVar("RunT", bound=RoundRun)


def summarize_rounds(
    runs: Sequence[RunT],
    targets: Sequence[str],
    fields: Sequence[str],
    per_round: Callable[[dict[str, RunT]], dict[str, float]],
) -> dict[str, Any]:
    """Medians over rounds of each of ``fields`` per target, and the median over rounds
    of each figure ``per_round`` makes from one round's runs (keyed by target).

    A ratio is taken within a round, then the median over rounds: the targets of
    one round ran back to back, so drift between rounds on a shared machine
    cancels out of it. Every round must hold every target ``per_round`` reads.
    """
    by_target = {
        target: {f: statistics.median(getattr(r, f) for r in runs if r.target == target)
                 for f in fields}
        for target in targets
    }  # fmt: skip
    by_round: dict[int, dict[str, RunT]] = {}
    for r in runs:
        by_round.setdefault(r.round, {})[r.target] = r
    figures = [per_round(rr) for rr in by_round.values()]
    ratios = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
    return {"targets": by_target, "ratios": ratios, "ratios_by_round": figures}


def write_results(path: Path, result: dict[str, Any]) -> None:
    """The run's JSON, NaN and infinity as null, next to the earlier results."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(result), indent=2, allow_nan=False) + "\n")


T = TypeVar("T")
#: Longest wait for one reading (an engine's counters, a front's metrics) before
#: it counts as missing: a busy llama-server may not answer its /metrics at all.
READING_TIMEOUT_S = 5.0
#: What a failed reading raises: connection errors and timeouts, a non-2xx page
#: (``raise_for_status``), a page that does not parse (JSON or Prometheus text).
READING_ERRORS = (aiohttp.ClientError, TimeoutError, ValueError, KeyError)


@dataclass(frozen=True, slots=True)
class MissingReading:
    """A reading that could not be taken, and why."""

    what: str
    reason: str

    def __str__(self) -> str:
        return f"{self.what}: n/a (missing: {self.reason})"


class Readings:
    """Takes a run's readings so that one that fails is recorded as missing (None)
    and the run goes on: losing a whole benchmark to one unanswered /metrics
    page costs more than a figure marked n/a.

    Usage: ``stats = await readings.take("engine counters", lambda: read(url))``;
    ``stats is None`` when it failed, and ``readings.missing`` says why.
    """

    __slots__ = ("missing", "timeout_s")

    def __init__(self, timeout_s: float = READING_TIMEOUT_S) -> None:
        self.missing: list[MissingReading] = []
        self.timeout_s = timeout_s

    async def take(self, what: str, read: Callable[[], Awaitable[T]]) -> T | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await read()
        except READING_ERRORS as exc:
            detail = str(exc).splitlines()[0] if str(exc) else ""
            reason = type(exc).__name__ + (f": {detail}" if detail else "")
            self.miss(what, reason)
            return None

    def miss(self, what: str, reason: str) -> None:
        self.missing.append(MissingReading(what, reason))

    def __repr__(self) -> str:
        return f"<Readings {len(self.missing)} missing>"
