"""FairScheduler: weights in, shares out. No sockets, no clock, no sleeps."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from proxy.scheduler import FairScheduler, Ticket

CLASSES = {"interactive": 8.0, "standard": 3.0, "batch": 1.0}


def ticket(tenant: str, priority: str = "standard", cost: float = 100.0) -> Ticket:
    return Ticket(tenant=tenant, priority=priority, cost=cost, enqueued_at=0.0, expires_at=1e9)


def run_backlogged(
    scheduler: FairScheduler, flows: list[tuple[str, str, float]], dispatches: int
) -> tuple[Counter[tuple[str, str]], dict[tuple[str, str], float]]:
    """Keep every flow backlogged (refill after each pop); count requests and cost."""
    for tenant, cls, cost in flows:
        for _ in range(3):
            scheduler.push(ticket(tenant, cls, cost))
    requests: Counter[tuple[str, str]] = Counter()
    tokens: dict[tuple[str, str], float] = defaultdict(float)
    for _ in range(dispatches):
        t = scheduler.pop()
        assert t is not None
        requests[(t.tenant, t.priority)] += 1
        tokens[(t.tenant, t.priority)] += t.cost
        scheduler.push(ticket(t.tenant, t.priority, t.cost))
    return requests, tokens


def test_class_shares_follow_class_weights_within_5_percent() -> None:
    """Three classes backlogged for 10,000 dispatches: shares 8:3:1 within 5%."""
    scheduler = FairScheduler(CLASSES)
    flows = [("t", cls, 100.0) for cls in CLASSES]
    requests, _ = run_backlogged(scheduler, flows, 10_000)
    total = sum(CLASSES.values())
    for cls, weight in CLASSES.items():
        share = requests[("t", cls)] / 10_000
        assert share == pytest.approx(weight / total, rel=0.05), (cls, share)


@pytest.mark.parametrize(
    "tenant_weights",
    [{"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 5.0, "b": 1.0}],
)
def test_tenant_shares_follow_tenant_weights_within_5_percent(
    tenant_weights: dict[str, float],
) -> None:
    """Tenants in one class, all backlogged: dispatch shares match tenant weights."""
    scheduler = FairScheduler(CLASSES, tenant_weights)
    flows = [(tenant, "standard", 100.0) for tenant in tenant_weights]
    requests, _ = run_backlogged(scheduler, flows, 10_000)
    total = sum(tenant_weights.values())
    for tenant, weight in tenant_weights.items():
        share = requests[(tenant, "standard")] / 10_000
        assert share == pytest.approx(weight / total, rel=0.05), (tenant, share)


def test_two_levels_compose() -> None:
    """Class share times tenant share inside the class, for every flow."""
    tenant_weights = {"a": 1.0, "b": 3.0}
    scheduler = FairScheduler({"interactive": 3.0, "batch": 1.0}, tenant_weights)
    flows = [(t, c, 50.0) for t in tenant_weights for c in ("interactive", "batch")]
    requests, _ = run_backlogged(scheduler, flows, 10_000)
    for tenant, cls in requests:
        expected = ({"interactive": 0.75, "batch": 0.25}[cls]) * tenant_weights[tenant] / 4.0
        assert requests[(tenant, cls)] / 10_000 == pytest.approx(expected, rel=0.05)
        assert scheduler.share_of(tenant, cls) == pytest.approx(expected)


def test_batch_is_not_starved_while_interactive_floods() -> None:
    """An interactive flood of many tenants still leaves batch its weighted share."""
    scheduler = FairScheduler(CLASSES)
    flows = [(f"flood{i}", "interactive", 100.0) for i in range(50)] + [("bulk", "batch", 100.0)]
    requests, _ = run_backlogged(scheduler, flows, 10_000)
    batch_share = requests[("bulk", "batch")] / 10_000
    assert batch_share >= 0.95 * (1.0 / 9.0)


def test_cost_aware_token_share_not_request_share() -> None:
    """A tenant whose requests are 10x larger gets the same tokens, a tenth of the requests."""
    scheduler = FairScheduler(CLASSES)
    flows = [("big", "standard", 1000.0), ("small", "standard", 100.0)]
    requests, tokens = run_backlogged(scheduler, flows, 11_000)
    big, small = ("big", "standard"), ("small", "standard")
    assert tokens[big] / tokens[small] == pytest.approx(1.0, rel=0.05)
    assert requests[small] / requests[big] == pytest.approx(10.0, rel=0.05)


def test_real_cost_corrects_the_charge() -> None:
    """Estimated 100 but really 1000: after correction the tenant yields to its peer."""
    scheduler = FairScheduler(CLASSES)
    for tenant in ("a", "b"):
        for _ in range(5):
            scheduler.push(ticket(tenant))
    first = scheduler.pop()
    assert first is not None
    scheduler.finished(first, actual_cost=1000.0)
    order = [t.tenant for _ in range(8) if (t := scheduler.pop()) is not None]
    # the other tenant gets the next dispatches until the 900 extra tokens are paid
    other = "b" if first.tenant == "a" else "a"
    assert order[:4] == [other] * 4


def test_idle_time_earns_no_credit() -> None:
    """A tenant that was idle does not get a burst of catch-up dispatches."""
    scheduler = FairScheduler(CLASSES)
    for _ in range(100):
        scheduler.push(ticket("busy"))
    for _ in range(50):
        assert scheduler.pop() is not None
    for _ in range(10):
        scheduler.push(ticket("late"))
    order = [t.tenant for _ in range(10) if (t := scheduler.pop()) is not None]
    assert 4 <= order.count("late") <= 6


def test_one_request_at_a_time_still_pays_its_cost() -> None:
    """A flow that empties and refills at once keeps its finish tag: no free restart."""
    scheduler = FairScheduler(CLASSES)
    for _ in range(200):
        scheduler.push(ticket("steady", cost=100.0))
    scheduler.push(ticket("sporadic", cost=1000.0))
    counts: Counter[str] = Counter()
    for _ in range(110):
        t = scheduler.pop()
        assert t is not None
        counts[t.tenant] += 1
        if t.tenant == "sporadic":
            scheduler.push(ticket("sporadic", cost=1000.0))
    assert counts["sporadic"] == pytest.approx(10, abs=2)


def test_blocked_tenant_is_passed_over_and_resumes() -> None:
    """A tenant at its cap keeps its queue but is skipped until unblocked."""
    scheduler = FairScheduler(CLASSES)
    for tenant in ("capped", "free"):
        for _ in range(3):
            scheduler.push(ticket(tenant))
    scheduler.set_blocked("capped", True)
    assert [t.tenant for _ in range(3) if (t := scheduler.pop())] == ["free"] * 3
    assert scheduler.pop() is None
    assert scheduler.depth("capped") == 3 and len(scheduler) == 3
    scheduler.set_blocked("capped", False)
    assert [t.tenant for _ in range(3) if (t := scheduler.pop())] == ["capped"] * 3
    assert len(scheduler) == 0


def test_remove_anywhere_keeps_order_and_counts() -> None:
    """Removing a queued ticket (timeout, cancel) from any position is exact."""
    scheduler = FairScheduler(CLASSES)
    tickets = [ticket("a") for _ in range(5)]
    for t in tickets:
        scheduler.push(t)
    assert scheduler.remove(tickets[2]) and scheduler.remove(tickets[0])
    assert not scheduler.remove(tickets[0])
    assert scheduler.depth("a") == 3 and scheduler.depth_by_class("a", "standard") == 3
    assert [scheduler.pop() for _ in range(3)] == [tickets[1], tickets[3], tickets[4]]
    assert scheduler.pop() is None and len(scheduler) == 0


def test_fifo_within_a_flow_and_a_tenants_classes_are_separate() -> None:
    """A tenant's batch backlog never blocks its own interactive request."""
    scheduler = FairScheduler(CLASSES)
    for _ in range(20):
        scheduler.push(ticket("a", "batch"))
    urgent = ticket("a", "interactive")
    scheduler.push(urgent)
    assert scheduler.pop() is urgent
