"""The phases test's workload file: tenants, request mix, SLOs, phases, faults.

Owns the frozen pydantic model of ``config/workload.example.yaml`` and
``load_workload``, which fails with *every* problem at its YAML path
(``tenants.chat.mix.huge: unknown request class``), reusing the proxy
config's error vocabulary (``ConfigError``, YAML line and column on syntax
errors, a key given twice refused). No I/O beyond reading the one file.

Shape (every key but ``request_classes``, ``tenants`` and ``phases`` has a
default)::

    seed: 1
    endpoint: chat                  # chat | completions
    model: null                     # null: the first of the target's /v1/models
    slo: {ttft_ms: 2000, total_ms: 20000, tpot_ms: null}
    request_classes:
      short: {input_tokens: [16, 64], max_tokens: 16}
    tenants:
      chat:
        api_key: sk-chat            # or api_key_env: NAME
        priority: interactive       # sent as X-Priority; omit for the tenant's default
        share: 2                    # relative share of the offered rate
        mix: {short: 1}             # relative share of each request class
        slo: {ttft_ms: 500}         # overrides the global slo key by key
    phases:
      - {name: baseline, duration_s: 10, rate_per_s: 5}
      - {name: ramp, duration_s: 10, rate_per_s: 5, to_rate_per_s: 20}
      - {name: burst, duration_s: 5, rate_per_s: 60,
         fault: {target: 0, error_rate: 0.3, error_status: 503}}
      - {name: recovery, duration_s: 10, rate_per_s: 5}
    drain_after: burst              # whose end the queue drain time is measured from

A phase's ``fault`` switches simulator faults (the fields of
``POST /sim/faults``) on at the phase's start and restores the previous
values at its end; ``target`` indexes the ``--fault-url`` list.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.config_errors import (
    ConfigError,
    ConfigIssue,
    Problems,
    issues_from_validation_error,
    read_document,
    rule_violations,
    with_rule_violations,
)
from proxy.loadtest.pause import PAUSE_FIELD
from proxy.sim.faults import FIELDS as FAULT_FIELDS
from proxy.sim.faults import Faults, FaultsError, update_faults

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DEFAULT_METRICS_INTERVAL_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "DEFAULT_TIMELINE_BIN_S",
    "Phase",
    "PhaseFault",
    "RequestClass",
    "Slo",
    "TenantLoad",
    "Workload",
    "WorkloadError",
    "load_workload",
    "parse_workload",
    "scale_durations",
]

DEFAULT_REQUEST_TIMEOUT_S = 120.0
DEFAULT_METRICS_INTERVAL_S = 0.5
DEFAULT_TIMELINE_BIN_S = 1.0
DEFAULT_DRAIN_TIMEOUT_S = 60.0
#: The generator's safety cap on unanswered requests (an open loop never waits below it).
DEFAULT_MAX_IN_FLIGHT = 5000


class WorkloadError(ConfigError):
    """A workload file that cannot be used; prints one ``path: message`` line per problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Slo(_Section):
    """A request is good when it succeeded and met every one of these that is set."""

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    total_ms: float | None = Field(default=None, gt=0)

    def merged(self, override: Slo | None) -> Slo:
        if override is None:
            return self
        return self.model_copy(update=override.model_dump(exclude_none=True))


class RequestClass(_Section):
    """One kind of request in the mix: prompt length range and output length."""

    input_tokens: tuple[int, int]
    max_tokens: int = Field(gt=0)
    stream: bool = True

    @field_validator("input_tokens")
    @classmethod
    def _check_range(cls, value: tuple[int, int]) -> tuple[int, int]:
        low, high = value
        if low < 1 or high < low:
            raise ValueError(f"must be [min, max] with 1 <= min <= max, got [{low}, {high}]")
        return value


class TenantLoad(_Section):
    """One tenant's traffic: its key, class, share of the load, mix and SLO."""

    api_key: str | None = None
    api_key_env: str | None = None
    priority: str | None = None
    share: float = Field(default=1.0, gt=0)
    mix: dict[str, float]
    slo: Slo | None = None

    @field_validator("mix")
    @classmethod
    def _check_mix(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("name at least one request class")
        bad = [name for name, weight in value.items() if weight <= 0]
        if bad:
            raise ValueError(f"weights must be > 0 (not {', '.join(bad)})")
        return value

    def key(self) -> str | None:
        """The API key to send; from the environment when ``api_key_env`` names it."""
        if self.api_key_env:
            return os.environ.get(self.api_key_env)
        return self.api_key


class PhaseFault(_Section):
    """Faults on for one phase: ``target`` plus any ``/sim/faults`` fields.

    ``pause: true`` is the one fault for a real engine: it goes to a pause
    controller (``proxy.loadtest.pause``) that freezes the engine's process
    for the phase, so it stands alone (a simulator does not know it).
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    target: int | str = 0

    @model_validator(mode="after")
    def _check_fields(self) -> PhaseFault:
        settings = self.settings()
        if PAUSE_FIELD in settings:
            return self._check_pause(settings)
        unknown = sorted(set(settings) - FAULT_FIELDS)
        problems: Problems = [((name,), "unknown simulator fault field") for name in unknown]
        if not settings:
            known = sorted(FAULT_FIELDS | {PAUSE_FIELD})
            problems.append(((), f"name at least one fault field: {', '.join(known)}"))
        if not problems:
            try:
                update_faults(Faults(), settings)
            except FaultsError as exc:
                problems.append(((), str(exc)))
        if isinstance(self.target, int) and self.target < 0:
            problems.append((("target",), "must be >= 0 (an index into --fault-url)"))
        if problems:
            raise rule_violations("fault", problems)
        return self

    def _check_pause(self, settings: Mapping[str, Any]) -> PhaseFault:
        problems: Problems = [
            ((name,), "pause stands alone: a pause controller knows no other fault field")
            for name in sorted(set(settings) - {PAUSE_FIELD})
        ]
        if settings[PAUSE_FIELD] is not True:
            problems.append(((PAUSE_FIELD,), "must be true (the phase freezes the engine)"))
        if isinstance(self.target, int) and self.target < 0:
            problems.append((("target",), "must be >= 0 (an index into --fault-url)"))
        if problems:
            raise rule_violations("fault", problems)
        return self

    def settings(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class Phase(_Section):
    """A stretch of open-loop Poisson arrivals at a constant or linearly ramped rate."""

    name: str = Field(min_length=1)
    duration_s: float = Field(gt=0)
    rate_per_s: float = Field(ge=0)
    to_rate_per_s: float | None = Field(default=None, ge=0)
    fault: PhaseFault | None = None

    @property
    def end_rate_per_s(self) -> float:
        return self.rate_per_s if self.to_rate_per_s is None else self.to_rate_per_s

    @property
    def mean_rate_per_s(self) -> float:
        return (self.rate_per_s + self.end_rate_per_s) / 2.0

    def rate_at(self, offset_s: float) -> float:
        """The asked arrival rate ``offset_s`` into the phase."""
        fraction = min(max(offset_s / self.duration_s, 0.0), 1.0)
        return self.rate_per_s + (self.end_rate_per_s - self.rate_per_s) * fraction


class Workload(_Section):
    """The whole phases test, validated across sections."""

    seed: int = 0
    endpoint: Literal["chat", "completions"] = "chat"
    model: str | None = None
    request_timeout_s: float = Field(default=DEFAULT_REQUEST_TIMEOUT_S, gt=0)
    metrics_interval_s: float = Field(default=DEFAULT_METRICS_INTERVAL_S, gt=0)
    timeline_bin_s: float = Field(default=DEFAULT_TIMELINE_BIN_S, gt=0)
    drain_timeout_s: float = Field(default=DEFAULT_DRAIN_TIMEOUT_S, ge=0)
    max_in_flight: int = Field(default=DEFAULT_MAX_IN_FLIGHT, gt=0)
    drain_after: str | None = None
    slo: Slo = Slo()
    request_classes: dict[str, RequestClass]
    tenants: dict[str, TenantLoad]
    phases: tuple[Phase, ...]

    @field_validator("request_classes", "tenants", "phases")
    @classmethod
    def _not_empty(cls, value: Any, info: ValidationInfo) -> Any:
        if not value:
            raise ValueError(f"at least one entry is required in {info.field_name}")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _check_references(cls, data: Any, handler: ModelWrapValidatorHandler[Workload]) -> Workload:
        """Names that refer across sections; reported with the other errors, not after them."""
        try:
            workload = handler(data)
        except ValidationError as exc:
            problems = _reference_problems(data) if isinstance(data, Mapping) else []
            if not problems:
                raise
            raise with_rule_violations(exc, problems) from None
        problems = _reference_problems(data) if isinstance(data, Mapping) else []
        if problems:
            raise rule_violations(cls.__name__, problems)
        return workload

    @property
    def duration_s(self) -> float:
        return sum(phase.duration_s for phase in self.phases)

    def drain_phase(self) -> Phase:
        """The phase whose end starts the drain clock: ``drain_after``, else the busiest."""
        if self.drain_after is not None:
            return next(p for p in self.phases if p.name == self.drain_after)
        named = [p for p in self.phases if p.name == "burst"]
        if named:
            return named[0]
        return max(self.phases, key=lambda p: max(p.rate_per_s, p.end_rate_per_s))

    def slo_for(self, tenant: str) -> Slo:
        return self.slo.merged(self.tenants[tenant].slo)


def _reference_problems(raw: Mapping[str, Any]) -> Problems:
    """Cross-section rules, read from the raw document so they work even when parts are invalid."""
    problems: Problems = []
    classes = raw.get("request_classes")
    known = set(classes) if isinstance(classes, Mapping) else None
    tenants = raw.get("tenants")
    for tenant_name, tenant in tenants.items() if isinstance(tenants, Mapping) else ():
        if not isinstance(tenant, Mapping):
            continue
        mix = tenant.get("mix")
        if known is not None and isinstance(mix, Mapping):
            for class_name in mix:
                if class_name not in known:
                    listed = ", ".join(sorted(str(k) for k in known)) or "none"
                    loc = ("tenants", str(tenant_name), "mix", str(class_name))
                    problems.append((loc, f"unknown request class (known: {listed})"))
        if tenant.get("api_key") and tenant.get("api_key_env"):
            problems.append(
                (("tenants", str(tenant_name)), "give api_key or api_key_env, not both")
            )
    phases = raw.get("phases")
    seen: dict[str, int] = {}
    for index, phase in enumerate(phases if isinstance(phases, list) else ()):
        name = phase.get("name") if isinstance(phase, Mapping) else None
        if not isinstance(name, str):
            continue
        if name in seen:
            message = f"duplicate phase name (also phases[{seen[name]}])"
            problems.append((("phases", index, "name"), message))
        seen.setdefault(name, index)
    drain_after = raw.get("drain_after")
    if isinstance(drain_after, str) and isinstance(phases, list) and drain_after not in seen:
        problems.append((("drain_after",), f"no phase is named {drain_after!r}"))
    return problems


def scale_durations(workload: Workload, factor: float) -> Workload:
    """``workload`` with every phase ``factor`` times as long (same rates and faults)."""
    if factor == 1.0:
        return workload
    phases = tuple(
        phase.model_copy(update={"duration_s": phase.duration_s * factor})
        for phase in workload.phases
    )
    return workload.model_copy(update={"phases": phases})


def parse_workload(text: str, source: str = "<string>") -> Workload:
    """A ``Workload`` from YAML text, or ``WorkloadError`` listing every problem."""
    try:
        document = read_document(text, source)
    except ConfigError as exc:
        raise WorkloadError(exc.issues, source) from None
    return workload_from_mapping(document, source)


def workload_from_mapping(document: Mapping[str, Any], source: str = "<mapping>") -> Workload:
    try:
        return Workload.model_validate(document)
    except ValidationError as exc:
        raise WorkloadError(issues_from_validation_error(exc), source) from None


def load_workload(path: str | os.PathLike[str]) -> Workload:
    """Read and validate the workload file at ``path``; every failure is a ``WorkloadError``."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(
            [ConfigIssue("<file>", f"cannot read {source}: {exc}")], source
        ) from None
    return parse_workload(text, source)
