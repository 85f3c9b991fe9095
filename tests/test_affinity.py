"""Prefix affinity: affinity keys of requests, and the consistent-hash ring with bounded loads."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from proxy.affinity import AffinityKey, HashRing, affinity_key, prompt_prefix

HEADER = "X-Session-Id"
SYSTEM = "You are a careful assistant for the ACME support desk. " * 40  # ~2,200 characters


def _key(body: object, headers: dict[str, str] | None = None, chars: int = 2048) -> int | None:
    return affinity_key(body, headers or {}, header=HEADER, prefix_chars=chars)


def _chat(system: str, user: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def _keys(count: int) -> list[AffinityKey]:
    """Fixed session keys: the same every run."""
    keys = [_key({}, {HEADER: f"session-{i}"}) for i in range(count)]
    return [AffinityKey(k) for k in keys if k is not None]


# --- affinity keys -------------------------------------------------------------------


OTHER_SYSTEM = SYSTEM.replace("ACME", "Globex")


@pytest.mark.parametrize(
    ("first", "second", "other"),
    [
        (
            _chat(SYSTEM, "reset my password"),
            _chat(SYSTEM, "where is my invoice?"),
            _chat(OTHER_SYSTEM, "reset my password"),
        ),
        (
            {"prompt": SYSTEM + "Q: one"},
            {"prompt": SYSTEM + "Q: two", "max_tokens": 9},
            {"prompt": OTHER_SYSTEM + "Q: one"},
        ),
        (
            {"prompt": [SYSTEM + "a", "other"]},
            {"prompt": [SYSTEM + "b"]},
            {"prompt": [OTHER_SYSTEM + "a"]},
        ),
        (
            {"inputs": SYSTEM + "first"},
            {"inputs": SYSTEM + "second"},
            {"inputs": OTHER_SYSTEM + "first"},
        ),
    ],
    ids=["chat", "completions", "prompt-list", "tgi-inputs"],
)
def test_same_prefix_same_key(
    first: dict[str, Any], second: dict[str, Any], other: dict[str, Any]
) -> None:
    """Two requests sharing their first affinity_prefix_chars characters: one key, whatever
    follows; a different system prompt: another key."""
    assert _key(first) == _key(second) is not None
    assert _key(other) != _key(first)


def test_short_prompts_differ_in_their_tail() -> None:
    """Prompts shorter than the prefix length are hashed whole: they differ when they differ."""
    assert _key(_chat("short", "a")) != _key(_chat("short", "b"))
    assert _key(_chat("short", "a"), chars=8) == _key(_chat("short", "b"), chars=8)


def test_system_messages_come_first_and_parts_count() -> None:
    """A system message after the user's is hashed first all the same; a multi-part content's
    text parts count like a plain string's text; roles are part of the text."""
    ordered = _chat("rules", "hi")
    swapped = {"messages": list(reversed(ordered["messages"]))}
    assert _key(swapped) == _key(ordered)
    parts = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "rules"}]},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:..."}},
                    {"type": "text", "text": "hi"},
                ],
            },
        ]
    }
    assert "rules" in prompt_prefix(parts, 100) and "hi" in prompt_prefix(parts, 100)
    as_user = {
        "messages": [{"role": "user", "content": "rules"}, {"role": "user", "content": "hi"}]
    }
    assert _key(as_user) != _key(ordered)


def test_a_chat_sessions_turns_share_the_key_of_its_head() -> None:
    """Each turn of a chat repeats the turns before it: the key is the conversation's
    head (system messages and the first user message), so a short session's second
    and third turns have its first turn's key and reach the same replica; twenty
    sessions keep their own keys, spread over the ring. (A key over the whole
    prompt moved 14 of 20 second turns on a ring of four.)"""
    ring = HashRing([f"gpu-{i}" for i in range(4)])
    idle = dict.fromkeys(ring.names, 0.0)
    homes = set()
    for session in range(20):
        turn1 = _chat("You are a helpful assistant.", f"Question number {session}?")["messages"]
        turn2 = [
            *turn1,
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "Why?"},
        ]
        turn3 = [
            *turn2,
            {"role": "assistant", "content": "Because."},
            {"role": "user", "content": "Ok"},
        ]
        keys = [_key({"messages": turn}) for turn in (turn1, turn2, turn3)]
        assert keys[0] is not None and keys[0] == keys[1] == keys[2]
        homes.add(ring.choose(AffinityKey(keys[0]), idle))
    assert len(homes) > 1


def test_header_overrides_prompt() -> None:
    """The affinity header, in any letter case, is the key whatever the prompt; an empty
    value is ignored."""
    a, b = _chat(SYSTEM, "x"), _chat("other system", "y")
    assert _key(a, {HEADER: "s-1"}) == _key(b, {"x-session-id": "s-1"}) is not None
    assert _key(a, {HEADER: "s-1"}) != _key(a, {HEADER: "s-2"})
    assert _key(a, {HEADER: "s-1"}) != _key(a)
    assert _key(a, {HEADER: "  "}) == _key(a)


@pytest.mark.parametrize(
    "body",
    [None, [], "text", {}, {"messages": "x"}, {"prompt": 5}, {"messages": []}, {"prompt": ""}],
)
def test_no_prompt_no_key(body: object) -> None:
    """A body without any prompt text and no header: no key (the caller routes least-loaded)."""
    assert _key(body) is None


def test_token_id_prompts_have_keys() -> None:
    """Completions with token ids (one list, or a list of lists): keyed by the first prompt."""
    assert _key({"prompt": [1, 2, 3]}) == _key({"prompt": [[1, 2, 3], [4]]}) is not None
    assert _key({"prompt": [1, 2, 3]}) != _key({"prompt": [1, 2, 4]})


def test_only_a_fixed_size_hash_is_kept() -> None:
    """The key is a 64-bit int, not text; a ring that chose for many keys keeps no trace of
    them (its state equals a fresh ring's)."""
    key = _key(_chat(SYSTEM, "secret question"), chars=4096)
    assert type(key) is int and 0 <= key < 2**64
    ring, fresh = HashRing(["a", "b"]), HashRing(["a", "b"])
    for k in _keys(100):
        ring.choose(k, {})
    for slot in HashRing.__slots__:
        assert getattr(ring, slot) == getattr(fresh, slot)


# --- the ring ------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [2, 3, 5, 8])
def test_keys_spread_evenly(replicas: int) -> None:
    """3,000 fixed sessions over an idle pool: every replica gets its share within 40%."""
    names = [f"gpu-{i}" for i in range(replicas)]
    ring = HashRing(names)
    counts = Counter(ring.choose(k, {}) for k in _keys(3000))
    assert set(counts) == set(names)
    share = 3000 / replicas
    assert all(0.6 * share <= n <= 1.4 * share for n in counts.values()), counts


def test_same_key_same_replica_while_load_allows() -> None:
    """A key's choice is stable across calls and equals its first replica on the ring."""
    ring = HashRing(["a", "b", "c"])
    for key in _keys(50):
        first = next(ring.walk(key))
        assert {ring.choose(key, {"a": 1, "b": 1, "c": 1}) for _ in range(3)} == {first}


def test_walk_visits_every_replica_once() -> None:
    """Walking from any key yields each replica exactly once."""
    ring = HashRing([f"r{i}" for i in range(7)])
    for key in _keys(20):
        walked = list(ring.walk(key))
        assert sorted(walked) == sorted(ring.names)
    assert list(HashRing([]).walk(AffinityKey(1))) == []


def test_removing_a_replica_moves_only_its_keys() -> None:
    """4 replicas, one removed: every key that preferred another replica keeps it, and only
    about a quarter of keys move; adding a fifth moves only the keys it now owns."""
    keys = _keys(4000)
    before = HashRing(["a", "b", "c", "d"])
    after = HashRing(["a", "b", "c"])
    moved = 0
    for key in keys:
        old, new = before.choose(key, {}), after.choose(key, {})
        if old != "d":
            assert new == old
        else:
            moved += 1
    assert 0.15 * len(keys) <= moved <= 0.35 * len(keys)
    grown = HashRing(["a", "b", "c", "d", "e"])
    changed = [k for k in keys if grown.choose(k, {}) != before.choose(k, {})]
    assert all(grown.choose(k, {}) == "e" for k in changed)
    assert 0.1 * len(keys) <= len(changed) <= 0.3 * len(keys)


@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_hot_key_spills_within_the_bound(factor: float) -> None:
    """One hot key, 60 requests held in flight (request counts): each lands on the first
    replica in ring order whose count, the request included, is within factor times the
    mean of that figure over the pool, so no replica exceeds factor * (mean + 1) and the
    preferred replica is the fullest."""
    ring = HashRing(["a", "b", "c"])
    key = _keys(1)[0]
    order = list(ring.walk(key))
    load = dict.fromkeys(ring.names, 0)
    for n in range(60):
        bound = factor * (n + 3) / 3
        expected = next(name for name in order if load[name] + 1 <= bound)
        chosen = ring.choose(key, load, max_load_factor=factor)
        assert chosen == expected
        load[chosen] += 1
        assert max(load.values()) <= factor * ((n + 1) / 3 + 1)
    assert load[order[0]] == max(load.values())
    assert load[order[0]] > 60 / 3 or factor == 1.0


def test_unbounded_hot_key_would_pile_up() -> None:
    """Baseline: with a huge factor the same hot key takes one replica for all 30 requests,
    which is what the bound prevents."""
    ring = HashRing(["a", "b", "c"])
    key = _keys(1)[0]
    load = dict.fromkeys(ring.names, 0)
    for _ in range(30):
        chosen = ring.choose(key, load, max_load_factor=1000.0)
        assert chosen is not None
        load[chosen] += 1
    assert sorted(load.values()) == [0, 0, 30]


def test_unusable_preferred_replica_goes_to_next_on_ring() -> None:
    """The preferred replica is not eligible (the caller's predicate: ejected, draining or
    without a free seat): the next one on the ring from the key takes it, then the one after
    when that one is out too; the ring itself is unchanged."""
    ring = HashRing(["a", "b", "c", "d"])
    for key in _keys(30):
        first, second, third, _ = ring.walk(key)
        usable = set(ring.names) - {first}
        assert ring.choose(key, {}, eligible=usable.__contains__) == second
        usable.discard(second)
        assert ring.choose(key, {}, eligible=usable.__contains__) == third
        assert ring.choose(key, {}) == first


def test_no_eligible_replica_is_none() -> None:
    """Nothing eligible: None, so the caller falls back to least-loaded (or waits)."""
    ring = HashRing(["a", "b"])
    assert ring.choose(_keys(1)[0], {}, eligible=lambda name: False) is None
    assert HashRing([]).choose(_keys(1)[0], {}) is None


def test_mean_counts_only_eligible_replicas() -> None:
    """An ejected idle replica does not lower the mean: with b ejected, a and c share the
    load as if the pool had two replicas."""
    ring = HashRing(["a", "b", "c"])
    key = next(k for k in _keys(200) if next(ring.walk(k)) == "a")
    load = {"a": 3, "b": 0, "c": 2}
    # Each replica's load with the request: a 4, c 3 (b 1). Over a and c the bound is
    # 1.25 * 7 / 2 = 4.375 and a fits; over all three it would be 1.25 * 8 / 3 = 3.33.
    assert ring.choose(key, load, eligible=lambda n: n != "b", max_load_factor=1.25) == "a"
    assert ring.choose(key, load, max_load_factor=1.25) != "a"


def test_repr_has_live_counts() -> None:
    assert repr(HashRing(["a", "b"], virtual_nodes=10)) == "<HashRing 2 replicas, 20 points>"


# --- weighted loads: prompt work, not request counts ------------------------------------


def _preferring(ring: HashRing, name: str) -> AffinityKey:
    return next(k for k in _keys(200) if next(ring.walk(k)) == name)


def test_a_cold_prefill_loads_its_replica() -> None:
    """a is computing one cold 2,000-token prompt, b is idle: a new cold request whose key
    prefers a goes to b (4,000 against 2,000 is over 1.25 times their mean), while a
    cached turn of that key (60 tokens) stays on a beside the prefill (2,060 against
    b's 2,000 to compute it cold)."""
    ring = HashRing(["a", "b"])
    key = _preferring(ring, "a")
    assert ring.choose(key, {"a": 2000.0}, work=lambda name: 2000.0) == "b"
    work = {"a": 60.0, "b": 2000.0}
    assert ring.choose(key, {"a": 2000.0}, work=work.__getitem__) == "a"


def test_a_cached_turn_stays_beside_cached_turns() -> None:
    """a runs two cached turns (60 tokens of work each), b is idle but holds nothing of
    the key: the third cached turn stays on a (180 against b's cold 2,000). Counted in
    requests (2 against 0, the old bound ceil(1.25 * 3 / 2) = 2) it spilled to b, where its
    whole prompt had to be computed."""
    ring = HashRing(["a", "b"])
    key = _preferring(ring, "a")
    work = {"a": 60.0, "b": 2000.0}
    assert ring.choose(key, {"a": 120.0}, work=work.__getitem__) == "a"
    assert ring.choose(key, {"a": 2}) == "b"


def test_a_loaded_home_sends_the_key_where_it_is_cached() -> None:
    """a (the key's home) is busy with 2,000 tokens of another key's prefill and would
    have to compute this prompt too; b holds it and runs nothing: the request goes to b
    (4,000 against 60). When b is the busy one, it goes home to a (2,000 against 2,060),
    and with both idle and both warm, home to a."""
    ring = HashRing(["a", "b"])
    key = _preferring(ring, "a")
    work = {"a": 2000.0, "b": 60.0}
    assert ring.choose(key, {"a": 2000.0, "b": 0.0}, work=work.__getitem__) == "b"
    assert ring.choose(key, {"a": 0.0, "b": 2000.0}, work=work.__getitem__) == "a"
    assert ring.choose(key, {}, work=dict.fromkeys("ab", 60.0).__getitem__) == "a"


@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_weighted_choice_is_within_the_bound(factor: float) -> None:
    """Random loads and works over four replicas: the choice's load plus work is within
    factor times the mean of load plus work, and every replica before it on the ring
    was over that bound."""
    rng = random.Random(15)
    ring = HashRing(["a", "b", "c", "d"])
    for key in _keys(200):
        load = {name: rng.choice([0.0, 60.0, 2000.0, 4000.0]) for name in ring.names}
        work = {name: rng.choice([1.0, 60.0, 2000.0]) for name in ring.names}
        chosen = ring.choose(key, load, max_load_factor=factor, work=work.__getitem__)
        after = {name: load[name] + work[name] for name in ring.names}
        bound = factor * sum(after.values()) / 4
        assert chosen is not None
        assert after[chosen] <= bound * (1 + 1e-9)
        for name in ring.walk(key):
            if name == chosen:
                break
            assert after[name] > bound
