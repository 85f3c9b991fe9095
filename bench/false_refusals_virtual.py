"""The false-refusal scenarios on a fake clock: the real dispatcher, no sockets, no noise.

``bench.false_refusals`` replays its scenarios through proxy processes in real
time, where a shared machine's CPU load moves seat times from one run to the
next. Here the same arrivals go through the ``Dispatcher`` itself on a
``FakeClock``: each request holds its seat exactly its token count times the
calibrated time per token, a killed replica is ejected at once and its
running requests end there (in the live run they fail and are retried), and a
request made to fail holds its seat for its timeout. What differs between
``normal``, ``twin`` and ``today`` is then the estimator alone.

Each run is its own process so that ``today`` imports the old revision's
``proxy`` package (``PYTHONPATH``); it prints one JSON object, the outcome of
every arrival (``served``, ``refused``, ``timed_out`` or ``failed``):

    python -m bench.false_refusals_virtual --scenario replica_loss --seat-s 0.1 --seeds 5
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import sys
from collections.abc import Sequence
from typing import Any

from bench.false_refusals import SCENARIOS, SEATS, Scenario, scenarios
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.errors import PredictedWaitExceedsBudget, QueueTimeout
from proxy.replicas import Replica, ReplicaPool
from proxy.scheduler import FairScheduler
from proxy.settings import BudgetsConfig, ReplicaConfig

# ``today`` runs an older revision's ``proxy/`` (before the redesign moved these).
try:
    from proxy.admitted import Deadline
    from proxy.scheduler import Ticket
except ImportError:  # pragma: no cover - only under an older revision
    from proxy.deadline import Deadline  # type: ignore[import-not-found,no-redef]
    from proxy.queues import Ticket  # type: ignore[import-not-found,no-redef]

CLASS_WEIGHTS = {"interactive": 8.0, "standard": 3.0, "batch": 1.0}


def replay(
    scenario: Scenario, *, token_s: float, predictive: bool = True, seed: int = 0
) -> list[str]:
    """Every arrival of ``scenario`` through one dispatcher on a fake clock.

    Bounded: each arrival, expiry and end is one event, and nothing adds events
    but them. Must run inside an event loop (the dispatcher makes futures); its
    real-time queue timers are cancelled, expiry runs on the fake clock.
    """
    clock = FakeClock(0.0)
    replicas = [
        Replica(ReplicaConfig(name=f"gpu-{i}", url=f"http://127.0.0.1:{i + 1}",
                              max_concurrency=SEATS))
        for i in range(2)
    ]  # fmt: skip
    tenants = {f"t{i}": TenantLimits(max_concurrency=None, queue_capacity=1000)
               for i in range(scenario.tenants)}  # fmt: skip
    pool = ReplicaPool(replicas, rng=random.Random(seed))
    extra: dict[str, Any] = {} if predictive else {"predictive_rejection": False}
    d = Dispatcher(pool, FairScheduler(CLASS_WEIGHTS), clock, tenants, **extra)
    budgets = BudgetsConfig(queue_ms=scenario.queue_ms, first_byte_ms=20000, total_ms=30000)
    arrivals = scenario.arrivals
    events: list[tuple[float, int, str, int]] = [
        (a.at_s, i, "arrive", i) for i, a in enumerate(arrivals)
    ]
    if scenario.kill_at_s is not None:
        events.append((scenario.kill_at_s, -1, "kill", -1))
    heapq.heapify(events)
    outcome = ["queued"] * len(arrivals)
    tickets: dict[int, Ticket] = {}
    order = len(arrivals)
    while events:
        at, _, kind, i = heapq.heappop(events)
        clock.advance(max(0.0, at - clock.now()))
        if kind == "arrive":
            deadline = Deadline.start(clock.now(), budgets)
            try:
                ticket = d.enqueue(f"t{arrivals[i].tenant}", "standard", 10.0, deadline)
            except PredictedWaitExceedsBudget:
                outcome[i] = "refused"
                continue
            tickets[i] = ticket
            if ticket.timer is not None:
                ticket.timer.cancel()
            heapq.heappush(events, (ticket.expires_at, order, "expire", i))
        elif kind == "expire" and outcome[i] == "queued" and tickets[i].seat is None:
            d._expire(tickets[i])
        elif kind == "end" and outcome[i] == "running":
            outcome[i] = "failed" if arrivals[i].timeout_ms is not None else "served"
            d.finish(tickets[i], tickets[i].seat)
        elif kind == "kill":
            _eject(replicas[-1])
            for j, ticket in tickets.items():
                seat = ticket.seat
                if outcome[j] == "running" and seat is not None and seat.replica is replicas[-1]:
                    outcome[j] = "failed"
                    d.finish(ticket, seat)
        for j, ticket in tickets.items():
            if outcome[j] != "queued":
                continue
            if ticket.seat is not None:
                outcome[j] = "running"
                arrival = arrivals[j]
                held = arrival.tokens * token_s
                if arrival.timeout_ms is not None:
                    held = min(held, arrival.timeout_ms / 1000.0)
                heapq.heappush(events, (clock.now() + held, order, "end", j))
            elif ticket.future is not None and ticket.future.done():
                assert isinstance(ticket.future.exception(), QueueTimeout)
                outcome[j] = "timed_out"
        order += 1
    return outcome


def _eject(replica: Replica) -> None:
    """Eject ``replica`` at once, on this revision or an older one (a plain flag there)."""
    move_to = getattr(replica, "move_to", None)
    if move_to is None:  # pragma: no cover - only under an older revision
        replica.ejected = True  # type: ignore[misc]
        return
    from proxy.replicas import ReplicaState

    move_to(ReplicaState.EJECTED)


async def _main(args: argparse.Namespace) -> list[str]:
    """Outcomes of ``--seeds`` runs of the scenario, one seed after another, concatenated."""
    outcomes: list[str] = []
    for seed in range(args.seed, args.seed + args.seeds):
        chosen = [s for s in scenarios(args.quick, seed, args.seat_s) if s.name == args.scenario]
        outcomes += replay(chosen[0], token_s=args.seat_s / 10, predictive=not args.twin)
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.false_refusals_virtual")
    parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    parser.add_argument("--seat-s", type=float, required=True, help="seat time of 10 tokens")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=1, help="runs, seeds from --seed on")
    parser.add_argument("--twin", action="store_true", help="predictive rejection off")
    args = parser.parse_args(argv)
    outcomes = asyncio.run(_main(args))
    json.dump({"outcomes": outcomes}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
