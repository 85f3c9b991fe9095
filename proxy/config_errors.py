"""Config problems: finding them across sections and reporting each at its YAML path.

A bad config must fail at start-up (and on reload) with *every* problem at
once, each at the path an operator would look for in the file:
``replicas[0].url``, ``tenants.acme.weight``, ``server.port``. This module owns
that vocabulary; ``settings.py`` owns the model and calls in here.

- ``ConfigIssue`` is one problem (path, message); ``ConfigError`` carries them
  all and prints one ``path: message`` line per issue.
- ``read_document`` parses YAML text, reporting syntax errors with line and
  column and refusing a key given twice (a tenant defined twice).
- The ``*_problems`` functions are the cross-field rules. They return
  ``(loc, message)`` pairs; ``rule_violations`` turns them into one pydantic
  ``ValidationError`` so a validator reports them all at exact locations.
- ``issues_from_validation_error`` turns pydantic's errors into issues in plain
  words, never echoing an API key.

Paths that are not YAML keys are written in angle brackets: ``<yaml>`` (syntax),
``<file>`` (unreadable), ``<root>`` (the document itself), ``<env>`` (an
environment override that could not be decoded). Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError


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


#: The pydantic error type of every cross-field rule.
RULE_ERROR_TYPE = "config_rule"
#: Prefix of an ``api_keys`` entry that stores a key's SHA-256 (hex) instead of the key.
SHA256_PREFIX = "sha256:"
#: Input values under a path containing one of these keys are never shown.
_SECRET_KEYS = frozenset({"api_keys"})

Loc = tuple[int | str, ...]
Problems = list[tuple[Loc, str]]
_M = TypeVar("_M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One problem in a config, at its YAML path."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(Exception):
    """A config that cannot be used; ``issues`` lists every problem found."""

    def __init__(self, issues: Iterable[ConfigIssue], source: str = "<string>") -> None:
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(str(issue) for issue in self.issues)


def rule(message: str) -> PydanticCustomError:
    """A single rule violation at the location being validated."""
    return PydanticCustomError(RULE_ERROR_TYPE, message)


def hash_api_key(key: str) -> str:
    """The SHA-256 hex digest of a client key: what ``Config.key_index`` is keyed by."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def stored_key_digest(entry: str) -> str:
    """The digest of an ``api_keys`` entry: plain keys hashed, ``sha256:`` entries as they are."""
    if entry.startswith(SHA256_PREFIX):
        return entry.removeprefix(SHA256_PREFIX)
    return hash_api_key(entry)


# --- reading ---------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping, where YAML keeps the last."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[object] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if isinstance(key, str | int | float | bool) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def read_document(text: str, source: str) -> Mapping[str, Any]:
    """The top-level mapping of a YAML config, or ``ConfigError`` with line and column."""
    try:
        document = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError([_yaml_issue(exc)], source) from None
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        kind = type(document).__name__
        message = f"the document must be a mapping of top-level keys, not a {kind}"
        raise ConfigError([ConfigIssue("<root>", message)], source)
    return document


def _yaml_issue(exc: yaml.YAMLError) -> ConfigIssue:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        message = f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
        if exc.context:
            message += f" ({exc.context})"
        return ConfigIssue("<yaml>", message)
    return ConfigIssue("<yaml>", str(exc))


# --- cross-field rules -----------------------------------------------------


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
        problems.append(((name, "priority"), f"{tenant.priority!r}: {unknown}"))
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


# --- reporting -------------------------------------------------------------


def format_path(loc: Sequence[int | str]) -> str:
    """A pydantic ``loc`` as a YAML path: ``("replicas", 0, "url")`` is ``replicas[0].url``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path or "<root>"


def rule_violations(title: str, problems: Sequence[tuple[Loc, str]]) -> ValidationError:
    """One ``ValidationError`` holding every cross-field problem at its own location.

    Raised inside a validator, pydantic keeps each line error and prefixes its
    location with the field being validated, so a tenants validator reporting
    ``("acme", "priority")`` surfaces as ``tenants.acme.priority``.
    """
    return ValidationError.from_exception_data(title, _rule_details(problems))


def with_rule_violations(
    exc: ValidationError, problems: Sequence[tuple[Loc, str]]
) -> ValidationError:
    """``exc`` with more cross-field problems appended, its own errors kept as they were."""
    details = [
        InitErrorDetails(
            type=PydanticCustomError(error["type"], error["msg"]),
            loc=tuple(error["loc"]),
            input=error.get("input"),
        )
        for error in exc.errors(include_url=False)
    ]
    return ValidationError.from_exception_data(exc.title, details + _rule_details(problems))


def _rule_details(problems: Sequence[tuple[Loc, str]]) -> list[InitErrorDetails]:
    return [InitErrorDetails(type=rule(message), loc=loc, input=None) for loc, message in problems]


def issues_from_validation_error(
    exc: ValidationError,
    *,
    env_prefix: str = "",
    env_delimiter: str = "__",
    environ: Mapping[str, str] | None = None,
) -> list[ConfigIssue]:
    """Pydantic's errors as issues, noting which value came from the environment.

    An environment override wins over the file, so a bad value there looks like
    a bad value in the file; naming the variable saves the operator a search.
    """
    env_names = {name.upper() for name in (os.environ if environ is None else environ)}
    issues = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        message = _plain_message(error["type"], error["msg"], error.get("input"), loc)
        if env_prefix:
            variable = _env_variable(loc, env_prefix, env_delimiter, env_names)
            if variable is not None:
                message += f" (from environment variable {variable})"
        issues.append(ConfigIssue(format_path(loc), message))
    return issues


def _plain_message(kind: str, message: str, value: object, loc: Loc) -> str:
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind != RULE_ERROR_TYPE:
        message = message.removeprefix("Value error, ")
        message = message[:1].lower() + message[1:]
    elif value is None:  # a cross-field rule: its message says it all
        return message
    secret = any(part in _SECRET_KEYS for part in loc)
    if not secret and (value is None or isinstance(value, str | int | float | bool)):
        message += f" (got {value!r})"
    return message


def _env_variable(loc: Loc, prefix: str, delimiter: str, env_names: set[str]) -> str | None:
    """The environment variable that set ``loc`` or one of its parents, if any."""
    parts = [str(part) for part in loc]
    for end in range(len(parts), 0, -1):
        name = (prefix + delimiter.join(parts[:end])).upper()
        if name in env_names:
            return name
    return None
