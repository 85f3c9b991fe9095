"""Fault injection state for the simulated replica.

Owns the `Faults` value (what misbehaviour is switched on), its validation
(shared by CLI flags, `POST /sim/faults` and `SimServer.set_faults`), and the
`FaultDice` that decide, with a seeded generator, which requests get an
injected error. It does no I/O: the server reads a `Faults` snapshot when a
request arrives and acts on it, so one request never sees half of an update.

Fields (all off by default):

- `error_rate` (0..1) and `error_status`: that fraction of inference requests
  is answered at once with that status and an OpenAI-style error body;
  `error_retry_after_s` adds a `Retry-After` header.
- `hang_before_first_byte_ms`: the request hangs that long before any response
  byte (`-1`: until the client leaves or the sim shuts down).
- `reset_mid_stream_after_tokens`: a stream's TCP connection is aborted (RST)
  after that many tokens; `None` is off.
- `slow_accept_ms`: delay before the request is read, on every route except
  `/sim/*`.
- `refuse_connections_ms`: the listener stops accepting connections for that
  long, counted from when the value is applied, then comes back on the same
  port (`-1`: until the value is set back to 0).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_ERROR_STATUS",
    "FOREVER",
    "FaultDice",
    "Faults",
    "FaultsError",
    "update_faults",
]

DEFAULT_ERROR_STATUS = 503
FOREVER = -1.0
"""Duration value meaning "until changed" (hang, refusal)."""


class FaultsError(ValueError):
    """A fault setting that cannot be applied; the message names the field."""


@dataclass(frozen=True, slots=True)
class Faults:
    """The misbehaviour switched on right now. Replaced whole, never mutated."""

    error_rate: float = 0.0
    error_status: int = DEFAULT_ERROR_STATUS
    error_retry_after_s: float | None = None
    hang_before_first_byte_ms: float = 0.0
    reset_mid_stream_after_tokens: int | None = None
    slow_accept_ms: float = 0.0
    refuse_connections_ms: float = 0.0

    def __post_init__(self) -> None:
        rate = _number("error_rate", self.error_rate)
        if not 0.0 <= rate <= 1.0:
            raise FaultsError(f"error_rate must be between 0 and 1, got {rate}")
        status = _integer("error_status", self.error_status)
        if not 400 <= status <= 599:
            raise FaultsError(f"error_status must be an HTTP error status (400..599), got {status}")
        if self.error_retry_after_s is not None:
            _non_negative("error_retry_after_s", self.error_retry_after_s)
        _duration("hang_before_first_byte_ms", self.hang_before_first_byte_ms)
        if self.reset_mid_stream_after_tokens is not None:
            tokens = _integer("reset_mid_stream_after_tokens", self.reset_mid_stream_after_tokens)
            if tokens < 0:
                raise FaultsError(f"reset_mid_stream_after_tokens must be >= 0, got {tokens}")
        _non_negative("slow_accept_ms", self.slow_accept_ms)
        _duration("refuse_connections_ms", self.refuse_connections_ms)

    @property
    def retry_after_header(self) -> str | None:
        """`Retry-After` value for injected errors: whole seconds, rounded up."""
        if self.error_retry_after_s is None:
            return None
        return str(math.ceil(self.error_retry_after_s))

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


FIELDS = frozenset(field.name for field in dataclasses.fields(Faults))


def update_faults(current: Faults, changes: Mapping[str, object]) -> Faults:
    """Return `current` with `changes` applied, or raise `FaultsError`.

    Unknown names are refused rather than ignored: a typo in a test's fault
    request must fail loudly, not silently leave the fault off.
    """
    unknown = sorted(set(changes) - FIELDS)
    if unknown:
        raise FaultsError(f"unknown fault field(s): {', '.join(unknown)}; known: {sorted(FIELDS)}")
    # Types are checked by Faults.__post_init__; the ignore covers the
    # Mapping[str, object] → field types step that it guards.
    return dataclasses.replace(current, **changes)  # type: ignore[arg-type]


class FaultDice:
    """Seeded decisions about which requests get an injected error.

    One draw per inference request while an error rate is set, so a given seed
    and request order always pick the same victims.
    """

    __slots__ = ("_rng", "errors_injected")

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self.errors_injected = 0

    def roll_error(self, faults: Faults) -> bool:
        if faults.error_rate <= 0.0:
            return False
        hit = self._rng.random() < faults.error_rate
        if hit:
            self.errors_injected += 1
        return hit

    def __repr__(self) -> str:
        return f"<FaultDice errors_injected={self.errors_injected}>"


def _number(name: str, value: object) -> float:
    # bool is an int subclass; `true` for a rate is a client bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultsError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise FaultsError(f"{name} must be finite, got {value!r}")
    return float(value)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FaultsError(f"{name} must be an integer, got {value!r}")
    return value


def _non_negative(name: str, value: object) -> None:
    if _number(name, value) < 0:
        raise FaultsError(f"{name} must be >= 0, got {value!r}")


def _duration(name: str, value: object) -> None:
    number = _number(name, value)
    if number < 0 and number != FOREVER:
        raise FaultsError(f"{name} must be >= 0, or -1 for 'until changed', got {value!r}")
