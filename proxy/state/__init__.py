"""Shared admission state: the limits several proxy processes enforce as one gateway.

The Redis side (``state.backend: redis``) of the limits the proxy already
enforces in memory: tenants' ``rate_per_s`` buckets (buckets.py), tenant
``max_concurrency`` places and replica seats as leases (leases.py, pair.py),
the fleet retry budget (retry_budget.py), token quotas with a local twin
(quota.py, quota_redis.py), the live instance registry (instances.py) and
seat-free notifications (notify.py), all through one client that bounds
every call and reports up/down (client.py). ``places.py`` is the request
path's ``SharedPlaces`` and ``shared.py`` assembles everything one process
needs (docs/ARCHITECTURE.md, "Shared state"). Queues stay local to each
process.

Key layout (``state.key_prefix`` then one hash tag per entity, so each script
touches one Redis Cluster slot; keys.py):

    admission:{t:acme}:bucket          hash tokens, stamp        rate_per_s bucket
    admission:{t:acme}:places          zset lease id -> expiry   max_concurrency places
    admission:{t:acme}:quota:minute    hash tokens, stamp        token_quota.per_minute
    admission:{t:acme}:quota:day       hash UTC day -> used      token_quota.per_day
    admission:{r:gpu-0}:seats          zset lease id -> expiry   max_concurrency + headroom
    admission:{fleet}:retry            hash q<s>, r<s> -> count  retry budget window
    admission:{fleet}:instances        zset instance -> expiry   live instances
    admission:freed:r:gpu-0            pub/sub channel           a seat was released
    admission:freed:t:acme             pub/sub channel           a tenant place was released

Every script reads the server's clock (``TIME``), never a process's, so
instances with skewed clocks agree; scripts need Redis 5 or newer (or Valkey).
"""
