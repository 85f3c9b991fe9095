"""Redis key and channel names of the shared state: one hash tag per entity.

Every key carries its entity in braces (``admission:{t:acme}:bucket``), so
Redis Cluster and Valkey hash all of one entity's keys to one slot and a
script may touch several of them; no script ever touches keys of two tags.
No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The tag of fleet-wide keys (retry budget, instance registry).
FLEET = "{fleet}"


@dataclass(frozen=True, slots=True)
class StateKeys:
    """Names under one ``state.key_prefix``; the prefix holds no braces (settings check it)."""

    prefix: str

    def _tenant(self, tenant: str) -> str:
        return f"{self.prefix}{{t:{tenant}}}"

    def _replica(self, replica: str) -> str:
        return f"{self.prefix}{{r:{replica}}}"

    def bucket(self, tenant: str) -> str:
        """Hash ``tokens``, ``stamp``: the tenant's ``rate_per_s`` bucket."""
        return f"{self._tenant(tenant)}:bucket"

    def tenant_places(self, tenant: str) -> str:
        """ZSET lease id -> expiry (ms): the tenant's ``max_concurrency`` places."""
        return f"{self._tenant(tenant)}:places"

    def seats(self, replica: str) -> str:
        """ZSET lease id -> expiry (ms): the replica's seats (``max_concurrency`` + headroom)."""
        return f"{self._replica(replica)}:seats"

    def waiting(self, replica: str) -> str:
        """ZSET ``<tenant>|<instance>`` -> expiry (ms): tenants refused a seat of the replica
        (fair sharing), one entry per process that asked."""
        return f"{self._replica(replica)}:waiting"

    def waiting_weights(self, replica: str) -> str:
        """Hash tenant -> weight of the tenants in ``waiting``."""
        return f"{self._replica(replica)}:waiting:weights"

    def quota_minute(self, tenant: str) -> str:
        """Hash ``tokens``, ``stamp``: the tenant's per-minute token bucket."""
        return f"{self._tenant(tenant)}:quota:minute"

    def quota_day(self, tenant: str) -> str:
        """Hash UTC day number -> tokens used that day; expires at the day's end."""
        return f"{self._tenant(tenant)}:quota:day"

    def retry_budget(self) -> str:
        """Hash ``q<second>`` / ``r<second>``: requests and retries per second."""
        return f"{self.prefix}{FLEET}:retry"

    def instances(self) -> str:
        """ZSET instance id -> heartbeat expiry (ms): the live gateway processes."""
        return f"{self.prefix}{FLEET}:instances"

    def admin_channel(self, group: str) -> str:
        """Pub/sub channel of one ``serve --workers`` group's admin changes."""
        return f"{self.prefix}admin:{group}"

    def admin_drained(self, group: str) -> str:
        """HASH replica -> "1": the replicas drained in one ``serve --workers`` group."""
        return f"{self.prefix}admin:{group}:drained"

    def freed_channel(self, pool: str) -> str:
        """Pub/sub channel told when a lease of ``pool`` is released (a replica pool, a tenant)."""
        return f"{self.prefix}freed:{pool}"
