"""CPU, GPU and memory of the proxy and the engines while a staircase level runs.

Owns ``ResourceSampler`` (a bounded background sampler, entered for the whole
run, marked at each level's start and end) and ``LevelResources`` (one
level's readings). Sources, by what the target exposes:

- **CPU and resident memory** of a process on this machine: ``/proc`` (the
  processes listening on the target's loopback port, and, through the proxy,
  on its loopback replicas' ports), as CPU seconds over the level's wall
  time: 1.0 is one core busy, as ``top`` counts. A process on another machine
  counts only if its ``/metrics`` exports ``process_cpu_seconds_total`` (vLLM
  does; read by ``scrape``).
- **GPU utilisation and memory**: NVML through ``pynvml`` when the target is
  on this machine and a driver answers; else the proxy's own GPU readings
  (``gpu`` of each replica in ``GET /admin/state``, sidecar mode). Without
  either, the report says which was missing and why.

Blocking reads (``/proc``, NVML) run in a worker thread. A reading that
fails is skipped, never fatal.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from proxy.loadtest.target import READ_TIMEOUT_S, TargetInfo
from proxy.tasks import stop
from proxy.telemetry.gpu import GpuProbe, GpuReading, NvmlProbe

__all__ = [
    "LevelResources",
    "ProcessSet",
    "ResourceSampler",
    "listening_pids",
    "nvml_unavailable_reason",
]

PROC = "/proc"
LISTEN = "0A"


def _listening_inodes(ports: Sequence[int], proc: str = PROC) -> set[str]:
    """Socket inodes in LISTEN state on any of ``ports`` (IPv4 and IPv6)."""
    wanted = {f"{port:04X}" for port in ports}
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}", encoding="ascii") as file:
                lines = file.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and fields[1][-4:] in wanted:
                inodes.add(fields[9])
    return inodes


def listening_pids(ports: Sequence[int], proc: str = PROC) -> dict[int, tuple[int, ...]]:
    """port -> the processes (of this user) listening on it, from ``/proc``; blocking.

    Several processes share a port when a server forks workers on one
    listening socket; all of them count.
    """
    found: dict[int, set[int]] = {port: set() for port in ports}
    for port in ports:
        inodes = _listening_inodes([port], proc)
        if not inodes:
            continue
        targets = {f"socket:[{inode}]" for inode in inodes}
        try:
            entries = [e for e in os.listdir(proc) if e.isdigit()]
        except OSError:
            return {}
        for pid in entries:
            try:
                fds = os.listdir(f"{proc}/{pid}/fd")
            except OSError:
                continue  # another user's process, or gone
            for fd in fds:
                try:
                    if os.readlink(f"{proc}/{pid}/fd/{fd}") in targets:
                        found[port].add(int(pid))
                        break
                except OSError:
                    continue
    return {port: tuple(sorted(pids)) for port, pids in found.items() if pids}


def _cpu_seconds(pid: int, proc: str = PROC) -> float | None:
    try:
        with open(f"{proc}/{pid}/stat", encoding="ascii") as file:
            text = file.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    try:  # utime and stime: fields 14 and 15, the 12th and 13th after the name
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError):
        return None


def _rss_bytes(pid: int, proc: str = PROC) -> int | None:
    try:
        with open(f"{proc}/{pid}/statm", encoding="ascii") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class ProcessSet:
    """The local processes of one role (``proxy`` or ``engine``)."""

    role: str
    pids: tuple[int, ...]

    def read(self) -> tuple[float | None, int | None]:
        """Total CPU seconds and resident bytes now; blocking."""
        cpu = [c for pid in self.pids if (c := _cpu_seconds(pid)) is not None]
        rss = [r for pid in self.pids if (r := _rss_bytes(pid)) is not None]
        return (sum(cpu) if cpu else None), (sum(rss) if rss else None)


def nvml_unavailable_reason() -> str | None:
    """None when NVML answers here; else why not, in words (blocking)."""
    try:
        import pynvml
    except ImportError:
        return "pynvml (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception as exc:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return f"NVML did not start ({type(exc).__name__}: no NVIDIA driver here)"
    return None if count > 0 else "NVML found no GPU"


@dataclass(frozen=True, slots=True)
class LevelResources:
    """One level's readings; None where nothing measured it."""

    proxy_cpu: float | None = None
    proxy_rss_bytes: int | None = None
    engine_cpu: float | None = None
    engine_rss_bytes: int | None = None
    gpu_utilization: float | None = None
    gpu_memory_ratio: float | None = None
    gpu_memory_free_bytes: int | None = None
    gpu_source: str | None = None
    #: Peak engine KV-cache usage (0..1) the proxy read from its replicas' metrics.
    kv_cache: float | None = None


@dataclass(slots=True)
class _Mark:
    wall: float
    cpu: dict[str, float | None]
    rss: dict[str, int | None]


@dataclass(slots=True)
class _GpuSample:
    t: float
    readings: tuple[GpuReading, ...]
    source: str


@dataclass(slots=True)
class ResourceSampler:
    """Samples GPUs every ``interval_s`` and reads process CPU at each level's marks.

    Enter it for the run; call ``mark()`` when a level starts and
    ``level(mark)`` when it ends. ``notes`` says what could not be measured
    and why (for the report).
    """

    info: TargetInfo
    base_url: str
    admin_headers: Mapping[str, str]
    interval_s: float = 0.5
    gpu_probe: GpuProbe | None = None
    local: bool = False
    #: Through the proxy, read this model pool's replicas only.
    pool: str | None = None
    notes: list[str] = field(default_factory=list)
    _processes: list[ProcessSet] = field(default_factory=list)
    _gpu: list[_GpuSample] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _session: aiohttp.ClientSession | None = None
    _kv: list[tuple[float, float]] = field(default_factory=list)
    #: Whether the proxy reported any GPU or engine reading (None: not asked yet);
    #: polling ``/admin/state`` stops at False.
    _proxy_readings: bool | None = None
    _zero: float = field(default_factory=time.perf_counter)

    async def __aenter__(self) -> ResourceSampler:
        await asyncio.to_thread(self._find_processes)
        if self.gpu_probe is None and self.local:
            reason = await asyncio.to_thread(nvml_unavailable_reason)
            if reason is None:
                self.gpu_probe = NvmlProbe()
            else:
                self.notes.append(f"GPU: not read through NVML on this machine: {reason}")
        elif self.gpu_probe is None:
            self.notes.append("GPU: the target is not on this machine, NVML not used")
        if self.info.is_proxy and self.info.admin:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1), cookie_jar=aiohttp.DummyCookieJar()
            )
        await self._sample_gpus()  # before any load: the idle reading
        self._task = asyncio.create_task(self._run(), name="loadtest-resources")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        task, self._task = self._task, None
        await stop(task)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _find_processes(self) -> None:
        if not self.local:
            self.notes.append("CPU: the target is not on this machine, /proc not read")
            return
        target_port = urlsplit(self.base_url).port
        ports = [p for p in (target_port, *self.info.engine_ports) if p is not None]
        found = listening_pids(ports)
        target_pids = found.get(target_port, ()) if target_port is not None else ()
        engine_pids = sorted(
            {pid for port in self.info.engine_ports for pid in found.get(port, ())}
        )
        if self.info.is_proxy:
            own = [pid for pid in engine_pids if pid not in target_pids]
            if target_pids:
                self._processes.append(ProcessSet("proxy", tuple(target_pids)))
            if own:
                self._processes.append(ProcessSet("engine", tuple(own)))
            elif engine_pids:
                self.notes.append(
                    "CPU: the proxy and its replicas run in one process; counted as the proxy's"
                )
        elif target_pids:
            self._processes.append(ProcessSet("engine", tuple(target_pids)))
        if not self._processes:
            self.notes.append("CPU: no process of this user listens on the target's port")
        elif os.getpid() in {pid for p in self._processes for pid in p.pids}:
            self.notes.append("CPU: the target runs inside the load generator's process")

    async def _run(self) -> None:
        while True:
            await self._sample_gpus()
            await asyncio.sleep(self.interval_s)

    async def _sample_gpus(self) -> None:
        """One round: NVML (or the given probe), else the proxy's GPU readings; KV cache."""
        now = time.perf_counter() - self._zero
        probe = self.gpu_probe
        sampled = False
        if probe is not None:
            try:
                readings = await asyncio.to_thread(probe.sample)
            except Exception:  # a failed NVML sample is skipped
                readings = []
            if readings:
                source = "nvml" if isinstance(probe, NvmlProbe) else "probe"
                self._gpu.append(_GpuSample(now, tuple(readings), source))
                sampled = True
        if self._session is None or self._proxy_readings is False:
            return
        state = await self._proxy_state()
        gpus, kv = _proxy_readings(state, self.pool) if state is not None else ([], None)
        self._proxy_readings = bool(gpus) or kv is not None or bool(self._proxy_readings)
        if gpus and not sampled:
            self._gpu.append(_GpuSample(now, tuple(gpus), "proxy"))
        if kv is not None:
            self._kv.append((now, kv))

    async def _proxy_state(self) -> dict[str, Any] | None:
        assert self._session is not None
        try:
            async with self._session.get(
                self.base_url + "/admin/state",
                headers=dict(self.admin_headers),
                timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S),
            ) as resp:
                if resp.status != 200:
                    await resp.read()
                    return None
                state = json.loads(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    async def mark(self) -> _Mark:
        """Readings at a level's start."""
        cpu, rss = await asyncio.to_thread(self._read_processes)
        return _Mark(time.perf_counter(), cpu, rss)

    def _read_processes(self) -> tuple[dict[str, float | None], dict[str, int | None]]:
        cpu: dict[str, float | None] = {}
        rss: dict[str, int | None] = {}
        for processes in self._processes:
            cpu[processes.role], rss[processes.role] = processes.read()
        return cpu, rss

    async def level(self, start: _Mark) -> LevelResources:
        """The level's readings since ``start``: CPU over its wall time, GPU peaks."""
        await self._sample_gpus()  # at least one GPU reading inside every level
        end = await self.mark()
        wall = max(end.wall - start.wall, 1e-9)

        def cpu(role: str) -> float | None:
            before, after = start.cpu.get(role), end.cpu.get(role)
            return None if before is None or after is None else max(0.0, after - before) / wall

        begin_t = start.wall - self._zero
        end_t = end.wall - self._zero
        samples = [s for s in self._gpu if begin_t <= s.t <= end_t]
        kv = [value for t, value in self._kv if begin_t <= t <= end_t]
        if not samples:
            return LevelResources(
                proxy_cpu=cpu("proxy"),
                proxy_rss_bytes=end.rss.get("proxy"),
                engine_cpu=cpu("engine"),
                engine_rss_bytes=end.rss.get("engine"),
                kv_cache=max(kv) if kv else None,
            )
        readings = [r for s in samples for r in s.readings]
        utilization = [max(r.utilization for r in s.readings) for s in samples]
        return LevelResources(
            proxy_cpu=cpu("proxy"),
            proxy_rss_bytes=end.rss.get("proxy"),
            engine_cpu=cpu("engine"),
            engine_rss_bytes=end.rss.get("engine"),
            gpu_utilization=sum(utilization) / len(utilization),
            gpu_memory_ratio=max(r.memory_ratio for r in readings),
            gpu_memory_free_bytes=min(max(0, r.memory_total - r.memory_used) for r in readings),
            gpu_source=samples[-1].source,
            kv_cache=max(kv) if kv else None,
        )

    def idle_gpu(self) -> LevelResources | None:
        """The GPU readings taken before any load (the first sample), if any."""
        if not self._gpu:
            return None
        readings = self._gpu[0].readings
        return LevelResources(
            gpu_memory_ratio=max(r.memory_ratio for r in readings),
            gpu_memory_free_bytes=min(max(0, r.memory_total - r.memory_used) for r in readings),
            gpu_source=self._gpu[0].source,
        )


def _proxy_readings(
    state: Mapping[str, Any], pool: str | None
) -> tuple[list[GpuReading], float | None]:
    """GPUs the proxy samples itself (replicas with ``gpu_index``) and the highest engine
    KV-cache reading of its replicas (of ``pool``'s when it names one)."""
    replicas: Mapping[str, Any] = state.get("replicas") or {}
    members = (state.get("pools") or {}).get(pool, {}).get("replicas") if pool else None
    gpus: dict[int, GpuReading] = {}
    kv: list[float] = []
    for index, (name, replica) in enumerate(replicas.items()):
        if not isinstance(replica, dict) or (members is not None and name not in members):
            continue
        gpu = replica.get("gpu")
        if isinstance(gpu, dict):
            gpus[index] = GpuReading(
                index,
                float(gpu.get("utilization") or 0.0),
                int(gpu.get("memory_used") or 0),
                int(gpu.get("memory_total") or 0),
            )
        engine = replica.get("engine")
        if isinstance(engine, dict) and engine.get("kv_cache") is not None:
            kv.append(float(engine["kv_cache"]))
    return list(gpus.values()), (max(kv) if kv else None)
