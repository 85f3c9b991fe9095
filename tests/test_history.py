"""The history ring behind the status page, and the routes that serve both.

The ring is tested on a fake clock with hand-made totals (no sockets, no
sleeps); the routes against the running proxy: ``/admin/history`` under the
admin rule, ``/admin/ui`` and its files without it, with their headers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from proxy.clock import FakeClock
from proxy.telemetry.history import HISTORY, MARK_EVERY_S, WAIT_WINDOW_S, History, Totals, quantile
from proxy.telemetry.metrics import LATENCY_BUCKETS
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
BOUNDS = (*LATENCY_BUCKETS, float("inf"))
ZERO = (0.0,) * len(BOUNDS)


def waits_at(index: int, count: float) -> tuple[float, ...]:
    counts = list(ZERO)
    counts[index] = count
    return tuple(counts)


def totals(
    ended: dict[tuple[str, str, str], float] | None = None,
    good: dict[str, float] | None = None,
    queue_waits: tuple[float, ...] = ZERO,
) -> Totals:
    return Totals(ended or {}, good or {}, {("queue", "a"): queue_waits}, BOUNDS)


@pytest.mark.parametrize(
    ("q", "counts", "expected"),
    [
        (0.5, [], None),
        (0.5, [0.0, 0.0], None),
        (0.5, [0.0, 10.0, 0.0], 0.0075),  # halfway into (0.005, 0.01]
        (0.95, [10.0, 0.0], 0.00475),  # 95% of the way into (0, 0.005]
        (0.5, [0.0] * (len(BOUNDS) - 1) + [4.0], 120.0),  # +Inf: the last finite bound
    ],
)
def test_quantile_interpolates_inside_a_bucket(
    q: float, counts: list[float], expected: float | None
) -> None:
    padded = counts + [0.0] * (len(BOUNDS) - len(counts))
    result = quantile(q, BOUNDS, padded)
    assert result == (pytest.approx(expected) if expected is not None else None)


def test_ring_keeps_the_last_points_and_serves_those_after_a_cursor() -> None:
    """A ring of 3 sampled 5 times keeps the newest 3; ``since(t)`` returns only newer ones."""
    clock = FakeClock()
    history = History(clock, interval_s=2.0, points=3)
    for i in range(5):
        history.sample({"tenants": {"a": {"queued": i, "inflight": 0}}, "replicas": {}}, totals())
        clock.advance(2.0)
    points = history.since(None)["points"]
    assert [p["tenants"]["a"]["queued"] for p in points] == [2, 3, 4]
    assert history.since(None)["window_s"] == 6.0
    newer = history.since(points[1]["t"])["points"]
    assert [p["tenants"]["a"]["queued"] for p in newer] == [4]
    assert repr(history) == "<History 3/3 points>"


def test_each_point_counts_what_ended_since_the_previous_one() -> None:
    """Cumulative counters in, per-interval deltas out: refusals by reason, completed, good;
    a client that hung up is not counted as refused."""
    clock = FakeClock()
    history = History(clock)
    history.sample({}, totals({("a", "completed", "none"): 3.0}, {"a": 2.0}))
    clock.advance(2.0)
    history.sample(
        {"tenants": {"a": {"queued": 1, "inflight": 2}}},
        totals(
            {
                ("a", "completed", "none"): 5.0,
                ("a", "rejected", "rate_limited"): 4.0,
                ("a", "timed_out", "queue_timeout"): 1.0,
                ("a", "cancelled", "client_closed"): 7.0,
                ("other", "rejected", "tenant_queue_full"): 2.0,
            },
            {"a": 3.0},
        ),
    )
    clock.advance(2.0)
    history.sample({}, totals({("a", "completed", "none"): 5.0}, {"a": 3.0}))
    first, second, third = history.since(None)["points"]
    assert first["tenants"]["a"] == {"queued": 0, "inflight": 0, "completed": 3, "good": 2}
    assert second["tenants"]["a"] == {
        "queued": 1,
        "inflight": 2,
        "completed": 2,
        "good": 1,
        "refused": {"rate_limited": 4, "queue_timeout": 1},
    }
    assert second["tenants"]["other"]["refused"] == {"tenant_queue_full": 2}
    assert third["tenants"] == {}
    assert (first["t"], second["t"], third["t"]) == (1000.0, 1002.0, 1004.0)


def test_waits_cover_the_last_window_only() -> None:
    """p50/p95 come from the wait buckets gained since a mark about WAIT_WINDOW_S ago:
    slow waits from before the window stop counting once it has passed."""
    clock = FakeClock()
    history = History(clock)
    slow = BOUNDS.index(10.0)
    history.sample({}, totals(queue_waits=ZERO))
    clock.advance(2.0)
    history.sample({}, totals(queue_waits=waits_at(slow, 10.0)))
    assert history.waits()["a"]["queue"]["count"] == 10.0
    assert history.waits()["a"]["queue"]["p50"] == pytest.approx(7.5)

    # Fast waits keep coming; after the window the slow ones have left it.
    fast = BOUNDS.index(0.01)
    elapsed = 2.0
    while elapsed < WAIT_WINDOW_S + 2 * MARK_EVERY_S:
        clock.advance(2.0)
        elapsed += 2.0
        counts = list(waits_at(slow, 10.0))
        counts[fast] = elapsed
        history.sample({}, totals(queue_waits=tuple(counts)))
    window = history.waits()["a"]["queue"]
    assert window["p95"] is not None and window["p95"] <= 0.01
    count = window["count"]
    assert count is not None and 0 < count <= WAIT_WINDOW_S + MARK_EVERY_S


async def test_admin_history_serves_the_ring_under_the_admin_rule(
    start_proxy: Start, upstream_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GET /admin/history`` answers the sampled points (a request counted as completed,
    the replica's state) with the token; 401 without it; 400 for a bad cursor."""
    monkeypatch.setenv("ADMISSION_ADMIN_TOKEN", "tok")
    proxy = await start_proxy(make_config([upstream_url]))
    admin = {"Authorization": "Bearer tok"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = await proxy.client.post(
        "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {KEY_A}"}
    )
    assert response.status == 200
    history = proxy.client.app[HISTORY]

    def counted() -> bool:
        points = history.since(None)["points"]
        return any(p["tenants"].get("a", {}).get("completed") for p in points)

    await wait_for(counted, timeout_s=10)
    assert (await proxy.client.get("/admin/history")).status == 401
    body = await (await proxy.client.get("/admin/history", headers=admin)).json()
    assert body["interval_s"] == 2.0
    assert sum(p["tenants"]["a"].get("completed", 0) for p in body["points"]) == 1
    assert body["points"][-1]["replicas"]["r0"]["state"] == "serving"
    later = await proxy.client.get(f"/admin/history?since={body['points'][-1]['t']}", headers=admin)
    assert all(p["t"] > body["points"][-1]["t"] for p in (await later.json())["points"])
    bad = await proxy.client.get("/admin/history?since=yesterday", headers=admin)
    assert bad.status == 400
    assert bad.headers["X-Admission-Reason"] == "bad_request"
    state = await (await proxy.client.get("/admin/state", headers=admin)).json()
    assert state["replicas"]["r0"]["state"] == "serving"
    assert state["replicas"]["r0"]["gpu"] is None


async def test_status_page_loads_without_the_token_with_strict_headers(
    start_proxy: Start, upstream_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page and its files hold no data: they load without the token, with a CSP that
    allows only this origin, nosniff and no-store; the page says a token is needed."""
    monkeypatch.setenv("ADMISSION_ADMIN_TOKEN", "tok")
    proxy = await start_proxy(make_config([upstream_url]))
    page = await proxy.client.get("/admin/ui")
    assert page.status == 200
    assert page.content_type == "text/html"
    text = await page.text()
    assert '<meta name="admin-auth" content="token">' in text
    assert "<script>" not in text and "style=" not in text  # nothing inline for the CSP
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert page.headers["Cache-Control"] == "no-store"
    assert page.headers["X-Request-Id"]
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        response = await proxy.client.get(f"/admin/ui/{name}")
        assert response.status == 200 and response.content_type == kind
        assert response.headers["X-Content-Type-Options"] == "nosniff"
    missing = await proxy.client.get("/admin/ui/secrets.txt")
    assert missing.status == 404 and missing.headers["X-Admission-Reason"] == "not_found"
    wrong = await proxy.client.post("/admin/ui")
    assert wrong.status == 405 and wrong.headers["Allow"] == "GET, HEAD"
    assert (await proxy.client.get("/admin/state")).status == 401


async def test_status_page_says_open_to_a_loopback_client_without_a_token(
    start_proxy: Start, upstream_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No token configured and a loopback client: the page skips its prompt."""
    monkeypatch.delenv("ADMISSION_ADMIN_TOKEN", raising=False)
    proxy = await start_proxy(make_config([upstream_url]))
    text = await (await proxy.client.get("/admin/ui")).text()
    assert '<meta name="admin-auth" content="open">' in text
