"""GPU readings are shown only while NVML gives them.

A sample that fails (a GPU fallen off the bus, a driver reset) used to leave
the last readings in place for good: ``admission_gpu_*`` showed a frozen
utilisation and memory as current, the spans carried them, and a replica held
off by the memory guard stayed held off, every dispatch to it stopped, on a
reading that no longer existed. A failed sample now drops the readings, as
stale engine metrics are dropped (back to seat counting), until one succeeds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from proxy.telemetry.gpu import FakeGpuProbe, GpuReading
from tests.conftest import ProxyUnderTest
from tests.helpers import make_config, samples_by_label, wait_for
from tests.upstreams import Upstream

Start = Callable[..., Awaitable[ProxyUnderTest]]


class BrokenProbe(FakeGpuProbe):
    """Readings until ``broken``; then every sample fails as NVML's do."""

    broken = False

    def sample(self) -> list[GpuReading]:
        if self.broken:
            raise RuntimeError("NVMLError_GpuIsLost")
        return super().sample()


async def test_a_failing_probe_shows_no_reading_and_holds_nothing_off(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    probe = BrokenProbe([GpuReading(0, 0.7, 95, 100)])
    config = make_config(
        [upstream_url],
        gpu={"memory_guard": 0.9, "sample_ms": 20},
        replicas=[{"name": "r0", "url": upstream_url, "max_concurrency": 4, "gpu_index": 0}],
    )
    proxy = await start_proxy(config, gpu=probe, ready=False)
    r0 = proxy.runtime.pool.replicas[0]
    await wait_for(lambda: r0.gpu_guarded)

    async def gauges() -> dict[str, float]:
        text = await (await proxy.client.get("/metrics")).text()
        return samples_by_label(text, "admission_gpu_memory_used_ratio", "gpu")

    assert await gauges() == {"0": 0.95}
    probe.broken = True
    await wait_for(lambda: not r0.gpu_guarded)
    assert await gauges() == {}
    assert proxy.runtime.gpu.snapshot == {}
    probe.broken = False
    await wait_for(lambda: r0.gpu_guarded)
    assert await gauges() == {"0": 0.95}
