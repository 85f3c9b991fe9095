"""Config reload: validate, swap in one step, keep the last good config.

Triggers: SIGHUP, a change of the config file's content (polled by hash,
because Kubernetes ConfigMaps change files by swapping symlinks, which inode
watches miss), and ``POST /admin/reload``. An invalid file changes nothing:
every error is logged with its YAML path and counted as
``admission_config_reloads_total{result="invalid"}``.

What a valid reload changes (docs/REFERENCE.md): new tenants, keys, weights,
caps, capacities, rate limits and budgets apply to new requests at once;
queued and running requests keep the deadline and class they were admitted
under and nothing queued is evicted; a removed tenant's queued tickets are
still served; a new replica is probed and warmed before it takes traffic; a
removed replica drains and then leaves; ``server.host``/``port`` changes are
logged as needing a restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

from proxy.replicas import Replica
from proxy.runtime import Rules, Runtime
from proxy.settings import Config, ConfigError, ConfigIssue, load_config

log = structlog.get_logger(__name__)

#: How often the config file's content hash is compared.
WATCH_INTERVAL_S = 2.0


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    issues: tuple[ConfigIssue, ...] = ()
    changed: bool = True


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class Reloader:
    def __init__(self, runtime: Runtime, path: str | os.PathLike[str]) -> None:
        self._runtime = runtime
        self._path = Path(path)
        self._lock = asyncio.Lock()
        self._digest = _digest(self._path)

    async def reload(self, trigger: str) -> ReloadResult:
        """Read, validate and apply the config file; one reload at a time."""
        async with self._lock:
            digest = await asyncio.to_thread(_digest, self._path)
            try:
                config = await asyncio.to_thread(load_config, self._path)
            except ConfigError as exc:
                for issue in exc.issues:
                    log.error("config reload refused", trigger=trigger, path=issue.path,
                              problem=issue.message)  # fmt: skip
                self._runtime.telemetry.metrics.config_reloads.labels("invalid").inc()
                self._digest = digest  # do not retry the same bad file every poll
                return ReloadResult(False, exc.issues)
            self._digest = digest
            apply_config(self._runtime, config)
            self._runtime.telemetry.metrics.config_reloads.labels("ok").inc()
            log.info("config reloaded", trigger=trigger, tenants=len(config.tenants),
                     replicas=[r.name for r in config.replicas])  # fmt: skip
            return ReloadResult(True)

    async def watch(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        """Reload whenever the file's content changes; runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            digest = await asyncio.to_thread(_digest, self._path)
            if digest is not None and digest != self._digest:
                await self.reload("file_change")


def apply_config(runtime: Runtime, config: Config) -> None:
    """Swap in a validated config: replicas first, then the rules in one assignment."""
    old = runtime.rules.config
    if (old.server.host, old.server.port) != (config.server.host, config.server.port):
        log.warning("server.host/port changed: takes effect after a restart",
                    running=f"{old.server.host}:{old.server.port}",
                    configured=f"{config.server.host}:{config.server.port}")  # fmt: skip
    pool = runtime.pool
    wanted = {r.name for r in config.replicas}
    for replica_config in config.replicas:
        api_key = os.environ.get(replica_config.api_key_env) if replica_config.api_key_env else None
        existing = pool.get(replica_config.name)
        if existing is not None and not existing.retired:
            existing.config = replica_config
            existing.url = replica_config.url
            existing.limit = replica_config.max_concurrency
            existing.headroom = replica_config.headroom
            existing.api_key = api_key
            continue
        replica = Replica(replica_config, api_key=api_key)
        # Treated as a replica whose ejection just ended: the next health round
        # probes and warms it before it takes traffic.
        replica.ejected = True
        pool.add(replica)
    for replica in pool.replicas:
        if replica.name not in wanted:
            pool.retire(replica.name)
    runtime.apply(Rules.from_config(config))
    runtime.dispatcher.pump()
