"""GPU readings from NVML, sampled off the event loop.

``GpuProbe`` is the seam: ``NvmlProbe`` reads real GPUs through ``pynvml``
(the nvidia-ml-py package), ``FakeGpuProbe`` serves tests. ``GpuSampler``
calls the probe in a worker thread every ``gpu.sample_ms`` and publishes an
immutable snapshot; the request path and the metrics read only the snapshot,
so NVML never blocks the event loop (docs/REFERENCE.md, guarantee 4).

Without a driver, ``nvmlInit`` raises ``NVMLError_LibraryNotFound``: the
probe reports itself unavailable once, with one log line, and every GPU
feature switches off while everything else works.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    utilization: float  # 0..1
    memory_used: int  # bytes
    memory_total: int  # bytes

    @property
    def memory_ratio(self) -> float:
        return self.memory_used / self.memory_total if self.memory_total else 0.0


class GpuProbe(Protocol):
    def available(self) -> bool:
        """False when there is no driver or no GPU: GPU features stay off."""
        ...

    def sample(self) -> list[GpuReading]:
        """Blocking: called in a worker thread."""
        ...


class NvmlProbe:
    """Real GPUs through NVML. Initialised lazily, in the sampler's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: bool | None = None  # None: not tried yet

    def available(self) -> bool:
        with self._lock:
            if self._state is None:
                self._state = self._init()
            return self._state

    @staticmethod
    def _init() -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            count = int(pynvml.nvmlDeviceGetCount())
        except Exception as exc:  # NVMLError_LibraryNotFound and friends, or no package
            log.info("gpu telemetry off: NVML unavailable", error=str(exc) or type(exc).__name__)
            return False
        log.info("gpu telemetry on", gpus=count)
        return count > 0

    def sample(self) -> list[GpuReading]:
        import pynvml

        readings = []
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            readings.append(
                GpuReading(index, util.gpu / 100.0, int(memory.used), int(memory.total))
            )
        return readings

    def close(self) -> None:
        with self._lock:
            if self._state:
                import pynvml

                pynvml.nvmlShutdown()
            self._state = None


class FakeGpuProbe:
    """A probe whose readings a test sets by hand."""

    def __init__(self, readings: list[GpuReading] | None = None) -> None:
        self.readings = readings or []

    def available(self) -> bool:
        return True

    def sample(self) -> list[GpuReading]:
        return list(self.readings)


class GpuSampler:
    """Publishes the latest readings as an immutable mapping; never blocks the loop.

    The interval can change while it runs (``set_interval``, on reload): the
    wait in progress is cut short, and the next sample is due one new
    interval after the last one.
    """

    def __init__(
        self, probe: GpuProbe, on_sample: Callable[[], None], interval_s: float = 1.0
    ) -> None:
        self._probe = probe
        self._on_sample = on_sample
        self.interval_s = interval_s
        self._changed = asyncio.Event()
        self.snapshot: Mapping[int, GpuReading] = {}

    def set_interval(self, interval_s: float) -> None:
        if interval_s != self.interval_s:
            self.interval_s = interval_s
            self._changed.set()

    async def run(self) -> None:
        if not await asyncio.to_thread(self._probe.available):
            return
        loop = asyncio.get_running_loop()
        failing = False
        while True:
            sampled_at = loop.time()
            try:
                readings = await asyncio.to_thread(self._probe.sample)
            except Exception as exc:
                # No reading is shown as current, and none holds a replica off (the
                # memory guard), while NVML fails: like stale engine metrics, the
                # last readings are dropped, not kept for good. Logged once a run.
                if not failing:
                    log.warning("gpu sample failed", error=str(exc) or type(exc).__name__)
                failing = True
                self.snapshot = {}
            else:
                if failing:
                    log.info("gpu samples again", gpus=len(readings))
                failing = False
                self.snapshot = {r.index: r for r in readings}
            self._on_sample()
            await self._wait_until_due(loop, sampled_at)

    async def _wait_until_due(self, loop: asyncio.AbstractEventLoop, sampled_at: float) -> None:
        """Sleep until one interval after ``sampled_at``, re-reading it when it changes."""
        while (left := sampled_at + self.interval_s - loop.time()) > 0:
            self._changed.clear()
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                return
