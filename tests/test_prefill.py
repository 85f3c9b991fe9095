"""The prefill ledger: uncached prompt work in flight per replica, and warm keys."""

from __future__ import annotations

import pytest

from proxy.affinity import AffinityKey
from proxy.prefill import MIN_WORK, PrefillLedger

KEY = AffinityKey(0x5EED)
OTHER = AffinityKey(0xF00D)


class _Seat:
    """A stand-in lease: the ledger only needs a hashable object per request."""


def test_a_new_key_counts_its_whole_cost() -> None:
    """Never sent anywhere: the request's whole cost is work, on every replica."""
    ledger = PrefillLedger()
    assert ledger.work(KEY, 2000.0, "a") == 2000.0
    assert ledger.work(KEY, 2000.0, "b") == 2000.0


def test_an_ended_request_warms_its_replica_only() -> None:
    """Turn 1 ended on a: turn 2 of the key counts only what turn 1 did not cover on a,
    and its whole cost on b; another key is cold on a."""
    ledger = PrefillLedger()
    seat = _Seat()
    ledger.started(seat, "a", KEY, 2000.0)
    ledger.ended(seat)
    assert ledger.work(KEY, 2060.0, "a") == 60.0
    assert ledger.work(KEY, 2060.0, "b") == 2060.0
    assert ledger.work(OTHER, 2060.0, "a") == 2060.0
    assert ledger.work(KEY, 1500.0, "a") == MIN_WORK  # shorter: taken as wholly cached


def test_a_request_in_flight_warms_nothing() -> None:
    """Two concurrent requests of a new key on one replica are both cold: an engine
    reuses a prefix only once it is computed."""
    ledger = PrefillLedger()
    first, second = _Seat(), _Seat()
    ledger.started(first, "a", KEY, 2000.0)
    ledger.started(second, "a", KEY, 2000.0)
    assert ledger.pending("a") == 4000.0
    assert ledger.count("a") == 2


def test_a_key_running_on_a_replica_is_cold_there() -> None:
    """Warm on a, but a request of the key still runs there: the next one counts in
    full on a (llama.cpp's slot holding the prompt is busy), cached again once the
    running one ends; another replica's warmth is unaffected."""
    ledger = PrefillLedger()
    for replica in ("a", "b"):
        seat = _Seat()
        ledger.started(seat, replica, KEY, 2000.0)
        ledger.ended(seat)
    running = _Seat()
    ledger.started(running, "a", KEY, 2060.0)
    assert ledger.pending("a") == 60.0
    assert ledger.work(KEY, 2120.0, "a") == 2120.0
    assert ledger.work(KEY, 2120.0, "b") == 120.0
    ledger.ended(running)
    assert ledger.work(KEY, 2120.0, "a") == 60.0


def test_pending_work_goes_back_to_zero() -> None:
    """Work pending per replica is the sum of its placed requests' work; it returns to
    exactly zero when they end, and ending a seat twice (or an unknown one) changes
    nothing."""
    ledger = PrefillLedger()
    warm = _Seat()
    ledger.started(warm, "a", KEY, 2000.0)
    ledger.ended(warm)
    seats = [_Seat() for _ in range(3)]
    ledger.started(seats[0], "a", KEY, 2060.1)  # 60.1: cached turn
    ledger.started(seats[1], "a", OTHER, 1900.3)  # cold
    ledger.started(seats[2], "b", KEY, 2060.1)  # cold on b
    assert ledger.pending("a") == pytest.approx(60.1 + 1900.3)
    assert ledger.pending("b") == 2060.1
    for seat in seats:
        ledger.ended(seat)
        ledger.ended(seat)
    ledger.ended(_Seat())
    assert (ledger.pending("a"), ledger.pending("b"), ledger.count("a")) == (0.0, 0.0, 0)
    assert repr(ledger) == "<PrefillLedger 0 in flight, 0 tokens pending, 2 keys warm>"


def test_an_undone_grant_warms_nothing() -> None:
    """A grant undone before anything was sent (``warmed=False``) frees its work and
    leaves the key cold there."""
    ledger = PrefillLedger()
    seat = _Seat()
    ledger.started(seat, "a", KEY, 2000.0)
    ledger.ended(seat, warmed=False)
    assert ledger.pending("a") == 0.0
    assert ledger.work(KEY, 2000.0, "a") == 2000.0


def test_warm_keys_are_bounded_least_recent_first() -> None:
    """At most max_keys keys are remembered; the one that ended longest ago goes first."""
    ledger = PrefillLedger(max_keys=2)
    keys = [AffinityKey(k) for k in (1, 2, 3)]
    for key in (keys[0], keys[1], keys[0], keys[2]):
        seat = _Seat()
        ledger.started(seat, "a", key, 100.0)
        ledger.ended(seat)
    assert ledger.work(keys[1], 100.0, "a") == 100.0  # forgotten
    assert ledger.work(keys[0], 100.0, "a") == MIN_WORK
    assert ledger.work(keys[2], 100.0, "a") == MIN_WORK
    assert repr(ledger) == "<PrefillLedger 0 in flight, 0 tokens pending, 2 keys warm>"
