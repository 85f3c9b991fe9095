"""``mode: observe``: forward every request at once, count what enforcing would refuse.

An operator adopting the proxy first watches what it would do. In observe
mode the dispatcher still runs every admission check, on the same numbers,
but a refusal only names the request (``would_<reason>``: the access line's
``observed`` field and ``admission_observed_refusals_total``) and the request
is forwarded anyway; nobody waits in a queue.

"Forwarded at once" means: a request that finds a free seat (or, below its
fair share, a headroom seat) takes it exactly as in enforce mode; any other
request, one enforce would have queued or refused, goes at once to the
least-loaded serving replica of its pool *above* its seat limit (an
overflow seat). Seats are still counted, overflow ones included, so
``/admin/state``, ``admission_replica_inflight`` (above the limit now) and
the wait estimates see the load the fleet really carries. What enforcing
would have queued is, per tenant, its overflow requests still running: the
"queue depth" the ``tenant_queue_full`` check reads in observe mode. So
headroom keeps its meaning only for who is counted where: it isolates
nobody, since nobody waits, and the engines run everything sent (their own
queues, vLLM's ``max_num_seqs``, take the excess).

Refusals observe mode can name: ``rate_limited`` (entrance),
``tenant_queue_full``, ``tenant_concurrency`` and
``predicted_wait_exceeds_budget`` (queue). A queue timeout cannot be
observed (nobody waits), but an overloaded flow is named at arrival by the
predicted wait. Refusals that are not admission decisions stay as they are:
authentication, bad requests, routes and models, ``no_healthy_replica``,
``shutting_down`` and ``retry_budget_exhausted``. While no replica of a pool
serves yet (all still warming), its requests wait as in enforce mode: there
is nowhere to forward them.

No I/O here; the dispatcher calls in.
"""

from __future__ import annotations

from proxy.pools import PoolSeats
from proxy.replicas import Replica

#: Prefix of every reason observe mode records instead of refusing.
WOULD = "would_"


def would(reason: str) -> str:
    """The observed name of a refusal: ``would_tenant_queue_full``."""
    return WOULD + reason


def overflow_replica(
    seats: PoolSeats, model: str | None, exclude: frozenset[str] = frozenset()
) -> Replica | None:
    """The replica an observed request goes to when no seat is free: the least
    loaded serving one of its pool, whatever its seats; one whose engine or GPU
    says to hold off, or in ``exclude`` (a retry's failed replica), only when
    no other serves."""
    members = seats.members(model)
    serving = [
        r for r in seats.pool.replicas if r.serving and (members is None or r.name in members)
    ]
    if not serving:
        return None
    return min(serving, key=lambda r: (not r.dispatchable, r.name in exclude, r.load))


class Overflow:
    """Per tenant, its requests running above the seat limits (observe mode): what
    enforce would have kept queued."""

    __slots__ = ("_by_ticket", "_depth")

    def __init__(self) -> None:
        self._by_ticket: dict[int, str] = {}
        self._depth: dict[str, int] = {}

    def started(self, ticket_id: int, tenant: str) -> None:
        self._by_ticket[ticket_id] = tenant
        self._depth[tenant] = self._depth.get(tenant, 0) + 1

    def ended(self, ticket_id: int) -> None:
        """Its seat went back (idempotent: the seat and the request may end apart)."""
        tenant = self._by_ticket.pop(ticket_id, None)
        if tenant is None:
            return
        left = self._depth[tenant] - 1
        if left:
            self._depth[tenant] = left
        else:
            del self._depth[tenant]

    def depth(self, tenant: str) -> int:
        return self._depth.get(tenant, 0)

    def __len__(self) -> int:
        return len(self._by_ticket)

    def __repr__(self) -> str:
        return f"<Overflow {len(self._by_ticket)} running above the seat limits>"
