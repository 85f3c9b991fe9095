"""The replica state machine: every move, legal and illegal, and the views of it."""

from __future__ import annotations

import itertools

import pytest

from proxy.replicas import TRANSITIONS, IllegalTransition, Replica, ReplicaState
from proxy.settings import ReplicaConfig

S = ReplicaState
#: (from, to): every move health.py makes; all other pairs must be refused.
LEGAL = {
    (S.STARTING, S.WARMING),
    (S.STARTING, S.SERVING),
    (S.STARTING, S.EJECTED),
    (S.WARMING, S.STARTING),
    (S.WARMING, S.EJECTED),
    (S.SERVING, S.STARTING),
    (S.SERVING, S.WARMING),
    (S.SERVING, S.EJECTED),
    (S.EJECTED, S.RETURNING),
    (S.EJECTED, S.SERVING),
    (S.EJECTED, S.EJECTED),
    (S.RETURNING, S.EJECTED),
}
#: How to reach each state from a new replica (SERVING) by legal moves.
PATH = {
    S.SERVING: [],
    S.STARTING: [S.STARTING],
    S.WARMING: [S.WARMING],
    S.EJECTED: [S.EJECTED],
    S.RETURNING: [S.EJECTED, S.RETURNING],
}


def replica_in(state: ReplicaState) -> Replica:
    replica = Replica(ReplicaConfig(name="r0", url="http://127.0.0.1:9", max_concurrency=2))
    for step in PATH[state]:
        replica.move_to(step)
    assert replica.health is state
    return replica


@pytest.mark.parametrize(("start", "end"), list(itertools.product(S, S)))
def test_every_transition_is_legal_or_refused_as_the_table_says(
    start: ReplicaState, end: ReplicaState
) -> None:
    replica = replica_in(start)
    if (start, end) in LEGAL:
        replica.move_to(end)
        assert replica.health is end
    else:
        with pytest.raises(IllegalTransition, match=f"{start.value} -> {end.value}"):
            replica.move_to(end)
        assert replica.health is start


def test_the_table_in_the_module_is_the_one_tested() -> None:
    assert {(a, b) for a, bs in TRANSITIONS.items() for b in bs} == LEGAL


@pytest.mark.parametrize(
    ("state", "starting", "warming", "ejected", "serving", "word"),
    [
        (S.STARTING, True, False, False, False, "starting"),
        (S.WARMING, True, True, False, False, "starting"),
        (S.SERVING, False, False, False, True, "serving"),
        (S.EJECTED, False, False, True, False, "ejected"),
        (S.RETURNING, False, True, True, False, "ejected"),
    ],
)
def test_the_flags_the_request_path_reads_are_views_of_the_state(
    state: ReplicaState, starting: bool, warming: bool, ejected: bool, serving: bool, word: str
) -> None:
    replica = replica_in(state)
    assert (replica.starting, replica.warming, replica.ejected) == (starting, warming, ejected)
    assert replica.serving is serving
    assert replica.state == word


def test_draining_is_an_operator_flag_beside_the_state() -> None:
    """Drain outlives an ejection, shows only over serving, and hold-offs stay separate."""
    replica = replica_in(S.SERVING)
    replica.draining = True
    assert not replica.serving and replica.state == "draining"
    replica.move_to(S.EJECTED)
    assert replica.state == "ejected" and replica.draining
    replica.move_to(S.SERVING)
    assert replica.state == "draining" and not replica.serving
    replica.draining = False
    replica.saturated = True
    assert replica.serving and not replica.dispatchable and replica.state == "serving"
    assert "saturated" in repr(replica)
