"""Scheduler micro-benchmark: FairScheduler against a plain heapq and deque.

100,000 queued tickets across 10,000 tenants in 3 classes. Reports time per
operation (enqueue, dispatch, and a steady-state enqueue+dispatch pair with
the queue full) and memory per queued ticket, beside the same tickets in a
plain ``heapq`` and a plain ``deque`` measured in the same run. Targets
(issue 3): at most 20 µs per operation and 2 KB per ticket.

    .venv/bin/python -m bench.scheduler [--tickets 100000] [--tenants 10000]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import itertools
import json
import random
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from pathlib import Path

from proxy.scheduler import FairScheduler, Ticket

CLASSES = {"interactive": 8.0, "standard": 3.0, "batch": 1.0}
TARGET_US_PER_OP = 20.0
TARGET_BYTES_PER_TICKET = 2048
RESULTS = Path(__file__).parent / "results"


def make_tickets(n: int, tenants: int, seed: int = 1) -> list[Ticket]:
    rng = random.Random(seed)
    classes = list(CLASSES)
    return [
        Ticket(
            tenant=f"tenant-{rng.randrange(tenants)}",
            priority=rng.choice(classes),
            cost=float(rng.randint(50, 4096)),
            enqueued_at=0.0,
            expires_at=1e9,
        )
        for _ in range(n)
    ]


class HeapBaseline:
    """The in-run baseline: one global heap ordered by arrival."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, Ticket]] = []
        self._seq = itertools.count()

    def push(self, ticket: Ticket) -> None:
        heapq.heappush(self._heap, (next(self._seq), ticket))

    def pop(self) -> Ticket | None:
        return heapq.heappop(self._heap)[1] if self._heap else None


class DequeBaseline:
    def __init__(self) -> None:
        self._queue: deque[Ticket] = deque()

    def push(self, ticket: Ticket) -> None:
        self._queue.append(ticket)

    def pop(self) -> Ticket | None:
        return self._queue.popleft() if self._queue else None


def _memory(factory: Callable[[], object], tickets: list[Ticket]) -> float:
    """Bytes the queue itself allocates per queued ticket (tracemalloc, separate pass)."""
    gc.collect()
    tracemalloc.start()
    queue = factory()
    push = queue.push  # type: ignore[attr-defined]
    before = tracemalloc.get_traced_memory()[0]
    for ticket in tickets:
        push(ticket)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(tickets)


def measure(factory: Callable[[], object], tickets: list[Ticket], tenants: int) -> dict[str, float]:
    """Time per operation without tracing, then memory in its own pass."""
    n = len(tickets)
    gc.collect()
    queue = factory()
    push = queue.push  # type: ignore[attr-defined]
    pop = queue.pop  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for ticket in tickets:
        push(ticket)
    t1 = time.perf_counter()
    # Steady state: the queue stays full; each step dispatches one and admits one.
    extra = make_tickets(n // 2, tenants, seed=2)
    t2 = time.perf_counter()
    for ticket in extra:
        pop()
        push(ticket)
    t3 = time.perf_counter()
    while pop() is not None:
        pass
    t4 = time.perf_counter()
    return {
        "enqueue_us": (t1 - t0) / n * 1e6,
        "dispatch_us": (t4 - t3) / n * 1e6,
        "steady_pair_us": (t3 - t2) / len(extra) * 1e6,
        "bytes_per_ticket_queue_only": _memory(factory, tickets),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tickets", type=int, default=100_000)
    parser.add_argument("--tenants", type=int, default=10_000)
    args = parser.parse_args()
    tickets = make_tickets(args.tickets, args.tenants)
    gc.collect()
    tracemalloc.start()
    sample = make_tickets(1000, args.tenants, seed=3)
    ticket_bytes = tracemalloc.get_traced_memory()[0] / len(sample)
    tracemalloc.stop()
    del sample
    results = {
        "FairScheduler": measure(
            lambda: FairScheduler(
                CLASSES, {f"tenant-{i}": 1.0 + i % 3 for i in range(args.tenants)}
            ),
            tickets,
            args.tenants,
        ),
        "heapq (baseline)": measure(HeapBaseline, tickets, args.tenants),
        "deque (baseline)": measure(DequeBaseline, tickets, args.tenants),
    }
    fair = results["FairScheduler"]
    heap = results["heapq (baseline)"]
    print(
        f"{args.tickets:,} tickets, {args.tenants:,} tenants, 3 classes; "
        f"a Ticket itself is about {ticket_bytes:.0f} bytes\n"
    )
    print(
        "| queue | enqueue µs | dispatch µs | steady enqueue+dispatch µs | bytes/ticket (queue) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['enqueue_us']:.2f} | {r['dispatch_us']:.2f} | "
            f"{r['steady_pair_us']:.2f} | {r['bytes_per_ticket_queue_only']:.0f} |"
        )
    per_op = max(fair["enqueue_us"], fair["dispatch_us"], fair["steady_pair_us"] / 2)
    total_bytes = fair["bytes_per_ticket_queue_only"] + ticket_bytes
    print(
        f"\nratio FairScheduler/heapq: enqueue {fair['enqueue_us'] / heap['enqueue_us']:.1f}x, "
        f"dispatch {fair['dispatch_us'] / heap['dispatch_us']:.1f}x, "
        f"steady pair {fair['steady_pair_us'] / heap['steady_pair_us']:.1f}x"
    )
    print(
        f"worst per-operation time {per_op:.2f} µs (target ≤ {TARGET_US_PER_OP:.0f}): "
        f"{'PASS' if per_op <= TARGET_US_PER_OP else 'MISS'}"
    )
    print(
        f"memory per queued ticket incl. the ticket {total_bytes:.0f} B "
        f"(target ≤ {TARGET_BYTES_PER_TICKET}): "
        f"{'PASS' if total_bytes <= TARGET_BYTES_PER_TICKET else 'MISS'}"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scheduler.json").write_text(
        json.dumps({"ticket_bytes": ticket_bytes, "results": results}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
