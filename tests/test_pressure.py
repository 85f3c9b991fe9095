"""Budget pressure on a fake clock: the p95 share of the queue budget, over 30 s, per class."""

from __future__ import annotations

import pytest

from proxy.admitted import Deadline
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.errors import QueueTimeout, TenantQueueFull
from proxy.pressure import WINDOW_S, BudgetPressure
from proxy.replicas import Replica, ReplicaPool
from proxy.scheduler import FairScheduler
from proxy.settings import BudgetsConfig, ReplicaConfig

BUDGETS = BudgetsConfig(queue_ms=2000, first_byte_ms=1000, total_ms=10000)


def test_no_sample_is_no_pressure() -> None:
    """A class nobody asked for, or with every sample out of the window, reads 0."""
    clock = FakeClock()
    pressure = BudgetPressure(clock)
    assert pressure.of("batch") == 0.0
    pressure.waited("batch", 1.0, 2.0)
    assert pressure.of("batch") == pytest.approx(0.5)
    clock.advance(WINDOW_S + 1)
    assert pressure.of("batch") == 0.0
    assert "idle" not in repr(pressure)


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ([0.0] * 20, 0.0),
        ([0.5] * 20, 0.5),
        # 100 waits 0.00 .. 0.99 of the budget: the 95th is 0.94 (rounded down to 0.01).
        ([i / 100 for i in range(100)], 0.94),
        # One refusal in 40 stays under the p95; two in 20 reach it.
        ([0.1] * 39 + [None], 0.1),
        ([0.1] * 18 + [None, None], 1.0),
    ],
)
def test_p95_of_the_budget_share(ratios: list[float | None], expected: float) -> None:
    """Waits as shares of the budget in, their p95 out; None is a refusal (counts 1)."""
    clock = FakeClock()
    pressure = BudgetPressure(clock)
    for ratio in ratios:
        if ratio is None:
            pressure.refused("batch")
        else:
            pressure.waited("batch", ratio * 2.0, 2.0)
    assert pressure.of("batch") == pytest.approx(expected, abs=1e-9)


def test_the_window_slides_second_by_second() -> None:
    """Samples older than 30 s leave the p95; newer ones stay; classes are apart."""
    clock = FakeClock(start=100.0)
    pressure = BudgetPressure(clock)
    for _ in range(10):
        pressure.refused("batch")  # at t=100
    clock.advance(20)
    for _ in range(10):
        pressure.waited("batch", 0.2, 2.0)  # at t=120: 0.1 of the budget
        pressure.waited("interactive", 0.0, 2.0)
    assert pressure.of("batch") == 1.0  # half the window used up its budget
    assert pressure.of("interactive") == 0.0
    clock.advance(9.5)  # t=129.5: the refusals at t=100 are 29.5 s old, still in
    assert pressure.of("batch") == 1.0
    clock.advance(1.0)  # t=130.5: they left the window
    assert pressure.of("batch") == pytest.approx(0.1)
    assert pressure.by_class(["batch", "interactive", "standard"]) == {
        "batch": pytest.approx(0.1), "interactive": 0.0, "standard": 0.0,
    }  # fmt: skip


def test_waits_past_the_budget_count_as_used_up() -> None:
    """A ratio above 1 (a late timer) and a zero budget both read as 1."""
    pressure = BudgetPressure(FakeClock())
    pressure.waited("batch", 3.0, 2.0)
    pressure.waited("standard", 0.0, 0.0)
    assert pressure.of("batch") == 1.0 and pressure.of("standard") == 1.0


def _dispatcher(clock: FakeClock, queue_capacity: int = 1) -> Dispatcher:
    replica = Replica(ReplicaConfig(name="r0", url="http://127.0.0.1:1", max_concurrency=1))
    limits = {"a": TenantLimits(max_concurrency=None, queue_capacity=queue_capacity)}
    scheduler = FairScheduler({"interactive": 8.0, "standard": 3.0, "batch": 1.0})
    return Dispatcher(ReplicaPool([replica]), scheduler, clock, limits)


async def test_the_dispatcher_feeds_pressure_from_each_queue_exit() -> None:
    """A grant at once counts 0, a grant after 1.5 s of a 2 s budget 0.75, a queue timeout
    1; a refusal for the tenant's own full queue is not counted: what the queue stage did,
    per class, on the dispatcher's clock."""
    clock = FakeClock()
    d = _dispatcher(clock)
    first = d.enqueue("a", "batch", 1.0, Deadline.start(clock.now(), BUDGETS))
    assert first.seat is not None
    waiting = d.enqueue("a", "batch", 1.0, Deadline.start(clock.now(), BUDGETS))
    with pytest.raises(TenantQueueFull):
        d.enqueue("a", "batch", 1.0, Deadline.start(clock.now(), BUDGETS))
    clock.advance(1.5)
    d.finish(first, first.seat)  # the waiting ticket gets the seat after 1.5 s
    assert waiting.seat is not None
    window = d.pressure._windows["batch"]
    assert sorted(i for i, n in enumerate(window.totals) for _ in range(n)) == [0, 75]
    late = d.enqueue("a", "interactive", 1.0, Deadline.start(clock.now(), BUDGETS))
    clock.advance(2.5)
    d.finish(waiting, waiting.seat)  # the pass finds it expired
    with pytest.raises(QueueTimeout):
        await d.wait(late)
    assert d.pressure.of("interactive") == 1.0
    assert d.pool.total_inflight() == 0 and len(d.scheduler) == 0


def test_each_model_pool_has_its_own_pressure_within_the_class() -> None:
    """Batch refused in alpha's pool, served at once in beta's: the class reads 1 (the
    gauge), alpha's pool 1, beta's 0, a pool never seen 0. Once the window has passed, a
    new sample drops the idle pools' windows (adapters come and go): only beta's is kept."""
    clock = FakeClock()
    pressure = BudgetPressure(clock)
    pressure.refused("batch", "alpha")
    pressure.waited("batch", 0.0, 2.0, "beta")
    assert pressure.of("batch") == 1.0
    assert (pressure.of("batch", "alpha"), pressure.of("batch", "beta")) == (1.0, 0.0)
    assert pressure.of("batch", "gamma") == 0.0
    clock.advance(WINDOW_S + 1)
    pressure.waited("batch", 1.0, 2.0, "beta")
    assert pressure.of("batch", "beta") == 0.5 and pressure.of("batch", "alpha") == 0.0
    assert list(pressure._pools) == [("batch", "beta")]
