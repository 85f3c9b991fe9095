"""The value the entrance hands to the rest of the path."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.deadline import Deadline

#: Bytes per prompt token when no tokenizer is at hand (docs/REFERENCE.md).
BYTES_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed the entrance: who, which class, by when, what."""

    tenant: str
    priority: str
    deadline: Deadline
    body: bytes
    streaming: bool
    seatless: bool
    inference: bool
    cost: float
    #: The normalised path (and the query as sent): what the replica receives.
    path_qs: str
