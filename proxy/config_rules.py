"""The cross-field rules of a config: what no single key can check alone.

Each ``*_problems`` function returns ``(loc, message)`` pairs, and the model
validators in ``settings.py`` and ``config_sections.py`` turn them into one
``ValidationError`` (``config_errors.rule_violations``) so that every problem
is reported at once, at its YAML path. ``valid_items`` lets the rules between
entries run while some entries are invalid on their own. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from proxy.config_errors import Problems, stored_key_digest
from proxy.models import allowed_model_problems, static_models


class _Named(Protocol):
    """A replica's config as the cross-replica rules read it (``settings.ReplicaConfig``)."""

    @property
    def name(self) -> str: ...


class _Budgets(Protocol):
    """Merged budgets (``settings.BudgetsConfig``)."""

    @property
    def queue_ms(self) -> int: ...
    @property
    def first_byte_ms(self) -> int: ...
    @property
    def total_ms(self) -> int: ...


class _Overrides(Protocol):
    """A tenant's budget overrides (``settings.BudgetOverrides``)."""

    @property
    def queue_ms(self) -> int | None: ...
    @property
    def first_byte_ms(self) -> int | None: ...
    @property
    def total_ms(self) -> int | None: ...


class _Tenant(Protocol):
    """A tenant's config as the cross-tenant rules read it (``settings.TenantConfig``).

    Structural types rather than the models themselves: ``settings`` imports
    these rules, so importing it back would make a cycle.
    """

    @property
    def api_keys(self) -> Sequence[str]: ...
    @property
    def priority(self) -> str: ...
    @property
    def allowed_priorities(self) -> Sequence[str] | None: ...
    @property
    def budgets(self) -> _Overrides: ...
    @property
    def allowed_models(self) -> Sequence[str] | None: ...


#: The pydantic error type of every cross-field rule.
_M = TypeVar("_M", bound=BaseModel)


def budget_problems(queue_ms: int, first_byte_ms: int, total_ms: int) -> list[tuple[str, str]]:
    """Layers that could never finish inside ``total_ms``, which clips every layer.

    Each layer alone must fit, and so must the queue wait and the first byte
    together (the total must cover both, plus the generation); that sum is
    reported at ``total_ms``, and only when neither layer alone is too long.
    """
    problems = [
        (key, f"{key} ({value}) is above total_ms ({total_ms})")
        for key, value in (("queue_ms", queue_ms), ("first_byte_ms", first_byte_ms))
        if value > total_ms
    ]
    if not problems and queue_ms + first_byte_ms > total_ms:
        problems.append(
            (
                "total_ms",
                f"queue_ms + first_byte_ms ({queue_ms} + {first_byte_ms} = "
                f"{queue_ms + first_byte_ms}) is above total_ms ({total_ms}): the total must "
                "cover the queue wait, the first byte and the generation",
            )
        )
    return problems


def valid_items(raw: object, model: type[_M]) -> dict[int | str, _M]:
    """The entries of a raw list or mapping that validate on their own, by index or key.

    Lets the rules between entries run while some entries are invalid, so one
    pass reports both kinds of problem.
    """
    if isinstance(raw, Mapping):
        entries: list[tuple[int | str, object]] = [(str(k), v) for k, v in raw.items()]
    elif isinstance(raw, list | tuple):
        entries = list(enumerate(raw))
    else:
        return {}
    valid: dict[int | str, _M] = {}
    for key, entry in entries:
        try:
            valid[key] = model.model_validate(entry)
        except ValidationError:
            continue
    return valid


def replica_problems(replicas: Mapping[int | str, _Named]) -> Problems:
    """Replica names are unique: they key seats, metrics and the drain endpoint."""
    first: dict[str, int | str] = {}
    problems: Problems = []
    for i, replica in replicas.items():
        if replica.name in first:
            seen = f"replicas[{first[replica.name]}]"
            problems.append(((i, "name"), f"duplicate replica name (already used by {seen})"))
        first.setdefault(replica.name, i)
    return problems


def tenant_problems(tenants: Mapping[str, _Tenant], before: Mapping[str, Any]) -> Problems:
    """Rules between tenants and the sections validated before them (``before``).

    A section that failed its own validation is absent from ``before``; the
    rules that need it are skipped rather than guessed at.
    """
    problems = _key_problems(tenants)
    anonymous = before.get("anonymous")
    for name, tenant in tenants.items():
        if "priorities" in before:
            problems += _class_problems(name, tenant, before["priorities"])
        if "budgets" in before:
            problems += _override_problems(name, tenant, before["budgets"])
        if tenant.allowed_models and "replicas" in before and "model_aliases" in before:
            static = static_models(before["replicas"])
            problems += [
                ((name, "allowed_models", i), message)
                for i, message in allowed_model_problems(
                    tenant.allowed_models, before["model_aliases"], static
                )
            ]
        if not tenant.api_keys and anonymous is not None and anonymous != name:
            problems.append(
                ((name, "api_keys"), "required (only the anonymous tenant may omit it)")
            )
    return problems


def anonymous_problem(anonymous: object, tenants: object, reject: str) -> str | None:
    """``anonymous`` is ``reject`` or a configured tenant; raw input of other types passes."""
    if not isinstance(anonymous, str) or not isinstance(tenants, Mapping):
        return None
    if anonymous == reject or anonymous in tenants:
        return None
    return f'{anonymous!r} must be "{reject}" or the name of a configured tenant'


def _key_problems(tenants: Mapping[str, _Tenant]) -> Problems:
    """A key, plain or hashed, opens one tenant only; the key itself is never quoted."""
    first: dict[str, str] = {}
    problems: Problems = []
    for name, tenant in tenants.items():
        for i, entry in enumerate(tenant.api_keys):
            digest = stored_key_digest(entry)
            if digest in first:
                problems.append(((name, "api_keys", i), f"duplicate API key (see {first[digest]})"))
            first.setdefault(digest, f"tenants.{name}.api_keys[{i}]")
    return problems


def _class_problems(name: str, tenant: _Tenant, priorities: Mapping[str, object]) -> Problems:
    unknown = f"unknown priority class (configured: {', '.join(priorities)})"
    problems: Problems = []
    if tenant.priority not in priorities:
        given = "priority" in getattr(tenant, "model_fields_set", {"priority"})
        # ``priorities`` replaced the defaults, and the tenant names no class: say so.
        default = "" if given else " (the default, as the tenant names none)"
        problems.append(((name, "priority"), f"{tenant.priority!r}{default}: {unknown}"))
    for i, cls in enumerate(tenant.allowed_priorities or ()):
        if cls not in priorities:
            problems.append(((name, "allowed_priorities", i), f"{cls!r}: {unknown}"))
    return problems


def _override_problems(name: str, tenant: _Tenant, budgets: _Budgets) -> Problems:
    """Merged budgets that cannot fit, reported at a key this tenant overrides.

    A layer above the total is reported at that layer, else at ``total_ms``;
    the queue-plus-first-byte sum at ``total_ms``, else at whichever of the two
    the tenant sets. When the tenant overrides none of the keys involved, the
    global ``budgets`` check has already reported it.
    """
    own = tenant.budgets
    queue_ms = budgets.queue_ms if own.queue_ms is None else own.queue_ms
    first_byte_ms = budgets.first_byte_ms if own.first_byte_ms is None else own.first_byte_ms
    total_ms = budgets.total_ms if own.total_ms is None else own.total_ms
    problems: Problems = []
    for key, message in budget_problems(queue_ms, first_byte_ms, total_ms):
        involved = (key, "first_byte_ms", "queue_ms") if key == "total_ms" else (key, "total_ms")
        where = next((k for k in involved if getattr(own, k) is not None), None)
        if where is not None:
            problems.append(((name, "budgets", where), f"merged {message}"))
    return problems
