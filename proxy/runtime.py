"""The proxy's live state: the rules of one config, and the parts that outlive it.

``Rules`` is everything derived from one validated ``Config`` (key index,
per-tenant budgets): immutable, swapped whole on reload, and read once per
request, so a request keeps the rules it was admitted under (docs/REFERENCE.md,
guarantee 5). ``Runtime`` holds the long-lived components (dispatcher, seats,
client session, telemetry); ``app.py`` builds it and owns its lifecycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.clock import Clock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.estimators import OutputTokens
from proxy.health import Health
from proxy.quotas import EntranceQuotas
from proxy.replicas import ReplicaPool
from proxy.retries import RetryBudget, RetryPolicy
from proxy.settings import BudgetsConfig, Config
from proxy.telemetry import Telemetry
from proxy.telemetry.gpu import FakeGpuProbe, GpuSampler
from proxy.upstream import upstream_timeout


@dataclass(frozen=True, slots=True)
class Rules:
    config: Config
    keys: Mapping[str, str]
    budgets: Mapping[str, BudgetsConfig]
    #: ``timeouts.connect_ms`` as aiohttp takes it, built once per config.
    upstream_timeout: aiohttp.ClientTimeout
    #: ``routes`` as a set: the allow-list is looked up once per path segment.
    routes: frozenset[str]

    @classmethod
    def from_config(cls, config: Config) -> Rules:
        return cls(
            config=config,
            keys=config.key_index(),
            budgets={name: config.budgets_for(name) for name in config.tenants},
            upstream_timeout=upstream_timeout(config.timeouts.connect_ms / 1000.0),
            routes=frozenset(config.routes),
        )

    def tenant_limits(self) -> dict[str, TenantLimits]:
        return {
            name: TenantLimits(max_concurrency=t.max_concurrency, queue_capacity=t.queue_capacity)
            for name, t in self.config.tenants.items()
        }

    def rate_limits(self) -> dict[str, tuple[float, float] | None]:
        return {
            name: (t.rate_per_s, t.effective_burst or 1.0) if t.rate_per_s is not None else None
            for name, t in self.config.tenants.items()
        }


@dataclass(slots=True)
class Runtime:
    rules: Rules
    clock: Clock
    pool: ReplicaPool
    dispatcher: Dispatcher
    quotas: EntranceQuotas
    telemetry: Telemetry
    health: Health
    retry_policy: RetryPolicy
    retry_budget: RetryBudget
    gpu: GpuSampler = field(default_factory=lambda: GpuSampler(FakeGpuProbe(), lambda: None))
    session: aiohttp.ClientSession | None = None
    #: Set when the proxy was started from a file (``serve``): reload reads it.
    reloader: Any = None
    shutting_down: bool = False
    #: The shutdown grace ran out: requests still in flight are being cut by the proxy.
    grace_over: bool = False
    #: Requests inside the handler right now (graceful shutdown waits for them).
    active: set[object] = field(default_factory=set)
    _idle: asyncio.Event | None = None
    #: Each tenant's recent mean output tokens: the cost of a request with no limit.
    output_tokens: OutputTokens = field(default_factory=OutputTokens)

    def enter(self, request: object) -> None:
        self.active.add(request)

    def leave(self, request: object) -> None:
        self.active.discard(request)
        if not self.active and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is inside the handler, at most ``timeout_s``."""
        if not self.active:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def apply(self, rules: Rules) -> None:
        """Swap in a new config's rules in one step (reload)."""
        self.rules = rules
        self.dispatcher.set_limits(rules.tenant_limits())
        scheduler = self.dispatcher.scheduler
        scheduler.set_class_weights({n: p.weight for n, p in rules.config.priorities.items()})
        scheduler.set_tenant_weights({n: t.weight for n, t in rules.config.tenants.items()})
        self.quotas.configure(rules.rate_limits())
        self.health.set_config(rules.config)
        self.telemetry.labels.reconfigure(
            rules.config.tenants, rules.config.telemetry.max_tenant_labels
        )
        self.gpu.set_interval(rules.config.gpu.sample_ms / 1000.0)
        retry = rules.config.retry
        self.retry_policy = RetryPolicy(retry)
        self.retry_budget.ratio, self.retry_budget.min_per_s = (
            retry.budget_ratio,
            retry.min_retries_per_s,
        )

    def client_session(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the upstream session is not open (app not started)")
        return self.session


#: The typed application key under which the app holds its runtime.
RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)
