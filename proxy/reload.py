"""Config reload: validate, swap in one step, keep the last good config.

Triggers: SIGHUP, a change of the config file's content (polled by hash,
because Kubernetes ConfigMaps change files by swapping symlinks, which inode
watches miss), and ``POST /admin/reload``. An invalid file changes nothing:
every error is logged with its YAML path and counted as
``admission_config_reloads_total{result="invalid"}``.

What a valid reload changes (docs/REFERENCE.md): every key but those of
``RESTART_KEYS`` (``server.host``, ``server.port`` and the listener's limits
``header_ms``, ``keepalive_ms``, ``max_connections``). New tenants, keys,
weights, caps, capacities, rate limits, budgets, timeouts (``connect_ms``
included), the body limit, the shutdown grace, the GPU sampling interval and
the metric label cap apply to new requests at once, and a new tenant gets its
own metric label if the cap has room; queued and running requests keep the
deadline, class and budgets they were admitted under and nothing queued is
evicted; a removed tenant's queued tickets are still served, under its old
rules; a new replica is probed and warmed before it takes traffic; a removed
replica drains and then leaves; a replica whose URL changed is both (the old
engine drains, the new one warms). A change to a ``RESTART_KEYS`` key is logged
as needing a restart, and the running config keeps the value the listener was
built with (so ``/admin/config`` shows what is in effect). A replica whose TLS
files changed (path or content) gets a new context; a rotated certificate
needs a reload to be read.

Every config that ran is kept in a ``ConfigHistory`` (``config_history``
entries, with the file's hash and the time it was applied); ``rollback``
applies the one before the running one, the same way a reload does. It
changes the running config, not the file: the watcher only reloads when the
file's content changes again, and a SIGHUP or ``POST /admin/reload`` reads
the file as it is.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
from aiohttp import web
from pydantic import BaseModel

from proxy.config_errors import mask_url_password
from proxy.config_history import ConfigEntry, ConfigHistory
from proxy.config_warnings import config_warnings
from proxy.errors import NoPreviousConfig
from proxy.replicas import Replica, ReplicaState
from proxy.runtime import Rules, Runtime
from proxy.settings import Config, ConfigError, ConfigIssue, load_config, read_config_bytes
from proxy.tls import ReplicaTls, same_files, tls_by_replica

log = structlog.get_logger(__name__)

#: How often the config file's content hash is compared.
WATCH_INTERVAL_S = 2.0
#: ``(section, key)`` pairs the listening server was built with (the address and
#: listener.py's limits): a reload leaves them as they are and logs that they take
#: effect after a restart.
RESTART_KEYS: tuple[tuple[str, str], ...] = (
    ("server", "host"),
    ("server", "port"),
    ("server", "header_ms"),
    ("server", "keepalive_ms"),
    ("server", "max_connections"),
    # The shared state's client, leases and subscription are built once at start.
    ("state", "backend"),
    ("state", "redis_url"),
    ("state", "key_prefix"),
    ("state", "lease_ms"),
    ("state", "timeout_ms"),
    ("state", "on_failure"),
)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    issues: tuple[ConfigIssue, ...] = ()
    changed: bool = True


def _digest(path: Path) -> str | None:
    """SHA-256 of the file (of its first ``MAX_CONFIG_BYTES`` + 1 bytes: a bigger one is
    refused anyway, and is not read whole every poll)."""
    try:
        return hashlib.sha256(read_config_bytes(path)).hexdigest()
    except OSError:
        return None


class Reloader:
    def __init__(self, runtime: Runtime, path: str | os.PathLike[str]) -> None:
        self._runtime = runtime
        self._path = Path(path)
        self._lock = asyncio.Lock()
        self._digest = _digest(self._path)
        #: Replicas a URL change displaced while they still ran requests (``apply_config``).
        self._displaced: dict[str, Replica] = {}
        #: What the listener was built from: ``RESTART_KEYS`` are compared to it.
        self._started = runtime.rules.config
        #: The good configs that ran, the running one last (``POST /admin/rollback``).
        self.history = ConfigHistory(self._started.config_history)
        self.history.applied(self._started, self._digest or "")

    async def reload(self, trigger: str, *, if_changed: bool = False) -> ReloadResult:
        """Read, validate and apply the config file; one reload at a time.

        ``if_changed``: only when the file is not what was last read (a reload passed
        on by another worker, whose watcher may have read the same change already).
        """
        async with self._lock:
            digest = await asyncio.to_thread(_digest, self._path)
            if if_changed and digest == self._digest:
                return ReloadResult(True, changed=False)
            try:
                config = await asyncio.to_thread(load_config, self._path)
                tls = await asyncio.to_thread(tls_by_replica, config.replicas)
            except ConfigError as exc:
                for issue in exc.issues:
                    log.error("config reload refused", trigger=trigger, path=issue.path,
                              problem=issue.message)  # fmt: skip
                self._runtime.telemetry.metrics.config_reloads.labels("invalid").inc()
                self._digest = digest  # do not retry the same bad file every poll
                return ReloadResult(False, exc.issues)
            self._digest = digest
            for warning in config_warnings(config):
                log.warning("config setting has no effect", path=warning.path,
                            problem=warning.message)  # fmt: skip
            for key, at_start, configured in needs_restart(self._started, config):
                log.warning("setting changed: takes effect after a restart", key=key,
                            running=at_start, configured=configured)  # fmt: skip
            running = keep_restart_keys(self._started, config)
            apply_config(self._runtime, running, tls, self._displaced)
            self.history.applied(running, digest or "")
            self._runtime.telemetry.metrics.config_reloads.labels("ok").inc()
            log.info("config reloaded", trigger=trigger, tenants=len(config.tenants),
                     replicas=[r.name for r in config.replicas])  # fmt: skip
            return ReloadResult(True)

    async def rollback(self) -> tuple[ConfigEntry, ConfigEntry]:
        """Apply the config before the running one: (now running, the one replaced).

        ``NoPreviousConfig`` when the history holds only the running config.
        Runs under the reload lock, so it never interleaves with a reload.
        """
        async with self._lock:
            previous = self.history.previous
            if previous is None:
                raise NoPreviousConfig(
                    "no earlier good config is kept (config_history holds the running one only)"
                )
            tls = await asyncio.to_thread(tls_by_replica, previous.config.replicas)
            apply_config(self._runtime, previous.config, tls, self._displaced)
            running, replaced = self.history.rolled_back()
            self._runtime.telemetry.metrics.config_reloads.labels("rolled_back").inc()
            log.warning("config rolled back", sha256=running.sha256,
                        applied_at=running.applied_at, replaced=replaced.sha256)  # fmt: skip
            return running, replaced

    async def watch(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        """Reload whenever the file's content changes; runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            digest = await asyncio.to_thread(_digest, self._path)
            if digest is not None and digest != self._digest:
                await self.reload("file_change")


def needs_restart(old: Config, new: Config) -> list[tuple[str, object, object]]:
    """The ``RESTART_KEYS`` whose value differs: (dotted key, old value, new value)."""
    changed = []
    for section, key in RESTART_KEYS:
        running = getattr(getattr(old, section), key)
        configured = getattr(getattr(new, section), key)
        if running != configured:
            if isinstance(running, str) and isinstance(configured, str):  # redis_url: no password
                running, configured = mask_url_password(running), mask_url_password(configured)
            changed.append((f"{section}.{key}", running, configured))
    return changed


def keep_restart_keys(started: Config, config: Config) -> Config:
    """``config`` with each ``RESTART_KEYS`` value put back to ``started``'s."""
    sections: dict[str, BaseModel] = {}
    for section, key in RESTART_KEYS:
        part = sections.get(section) or getattr(config, section)
        value = getattr(getattr(started, section), key)
        sections[section] = part.model_copy(update={key: value})
    return config.model_copy(update=sections)


def apply_config(
    runtime: Runtime,
    config: Config,
    tls: Mapping[str, ReplicaTls | None] | None = None,
    displaced: dict[str, Replica] | None = None,
) -> None:
    """Swap in a validated config: replicas first, then the rules in one assignment.

    ``tls``: every replica's context, built off the loop (``tls_by_replica``);
    a replica keeps its context, and its pooled connections, while its TLS
    files are unchanged. ``displaced`` (the reloader's, kept across reloads):
    replicas whose name a new URL took while they still run requests, so that
    a reload or rollback back to their URL puts them back, counting what they
    run, instead of a second replica for one engine.
    """
    if tls is None:
        tls = tls_by_replica(config.replicas)
    if displaced is None:
        displaced = {}
    for name in [name for name, r in displaced.items() if r.inflight == 0]:
        del displaced[name]  # its last requests ended: nothing left to put back
    pool = runtime.pool
    wanted = {r.name for r in config.replicas}
    for replica_config in config.replicas:
        api_key = os.environ.get(replica_config.api_key_env) if replica_config.api_key_env else None
        name = replica_config.name
        existing = pool.get(name)
        stash = None
        if existing is not None and existing.url != replica_config.url:
            # Another engine under the same name (moved to a new host): the old one
            # drains where it is, the new one is probed and warmed before it serves,
            # as a new replica is. In place, traffic went at once to an engine maybe
            # still loading, with the old one's models and readings.
            if not existing.retired:
                pool.retire(name)
            stash = existing if existing.inflight else None
            existing = None
        if existing is None:
            earlier = displaced.pop(name, None)
            if earlier is not None and earlier.url == replica_config.url:
                pool.add(earlier)  # back to an engine still draining: put back below
                existing = earlier
        if stash is not None:
            displaced[name] = stash
        if existing is not None and existing.retired and existing.url == replica_config.url:
            # Put back (a reload, a rollback) while its last requests still drain:
            # the same engine, so the same replica, whose seats count what it runs
            # now. A new one next to it would count 0 and exceed max_concurrency.
            existing.retired = existing.draining = False
        if existing is not None and not existing.retired:
            existing.reconfigure(replica_config, api_key)
            if not same_files(existing.tls, tls[replica_config.name]):
                existing.set_tls(tls[replica_config.name])
                log.info("replica TLS files changed: new connections use them",
                         replica=existing.name)  # fmt: skip
            continue
        replica = Replica(replica_config, api_key=api_key, tls=tls[replica_config.name])
        # Not healthy yet: the next health round probes and warms it before it
        # takes traffic, and failures keep it starting, never ejected.
        replica.move_to(ReplicaState.STARTING)
        pool.add(replica)
    for replica in pool.replicas:
        if replica.name not in wanted:
            pool.retire(replica.name)
    runtime.apply(Rules.from_config(config))
    runtime.dispatcher.pump()


#: The app's reloader; None when the proxy was started without a config file.
RELOADER: web.AppKey[Reloader | None] = web.AppKey("reloader")
