"""Config problems: reporting each at its YAML path.

A bad config must fail at start-up (and on reload) with *every* problem at
once, each at the path an operator would look for in the file:
``replicas[0].url``, ``tenants.acme.weight``, ``server.port``. This module owns
that vocabulary; ``settings.py`` owns the model and calls in here.

- ``ConfigIssue`` is one problem (path, message); ``ConfigError`` carries them
  all and prints one ``path: message`` line per issue.
- ``read_document`` parses YAML text, reporting syntax errors with line and
  column and refusing a key given twice (a tenant defined twice).
- The cross-field rules (``config_rules.py``) return ``(loc, message)``
  pairs; ``rule_violations`` turns them into one pydantic ``ValidationError``
  so a validator reports them all at exact locations.
- ``issues_from_validation_error`` turns pydantic's errors into issues in plain
  words, never echoing an API key.

Paths that are not YAML keys are written in angle brackets: ``<yaml>`` (syntax),
``<file>`` (unreadable), ``<root>`` (the document itself), ``<env>`` (an
environment override that could not be decoded). Nothing here does I/O.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

RULE_ERROR_TYPE = "config_rule"
#: Prefix of an ``api_keys`` entry that stores a key's SHA-256 (hex) instead of the key.
SHA256_PREFIX = "sha256:"
#: Input values under a path containing one of these keys are never shown.
_SECRET_KEYS = frozenset({"api_keys"})

Loc = tuple[int | str, ...]
Problems = list[tuple[Loc, str]]


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


def mask_url_password(value: str) -> str:
    """``value`` with the password of a ``scheme://user:password@host`` URL as ``***``.

    A Redis URL (``redis://:password@host``) or an upstream URL may carry a
    password; the effective config (``check-config``, ``GET /admin/config``),
    errors and logs show the URL without it. Anything else is returned as is.
    """
    scheme, sep, rest = value.partition("://")
    if not sep:
        return value
    authority, slash, tail = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if not at or ":" not in userinfo:
        return value
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{host}{slash}{tail}"


def stored_key_digest(entry: str) -> str:
    """The digest of an ``api_keys`` entry: plain keys hashed, ``sha256:`` entries as they are."""
    if entry.startswith(SHA256_PREFIX):
        return entry.removeprefix(SHA256_PREFIX)
    return hash_api_key(entry)


# --- reading ---------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping, where YAML keeps the last."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    """Keys written twice in this mapping are an error; keys a merge (``<<: *defaults``)
    brings in are not: a key written next to the merge overrides it, as YAML says."""
    seen: set[object] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
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
        if "'\\t'" in str(exc.problem):
            message += "; YAML indents with spaces, never tabs"
        return ConfigIssue("<yaml>", message)
    return ConfigIssue("<yaml>", str(exc))


# --- reporting -------------------------------------------------------------


def format_path(loc: Sequence[int | str]) -> str:
    """A pydantic ``loc`` as a YAML path: ``("replicas", 0, "url")`` is ``replicas[0].url``.

    A mapping key that is empty or holds whitespace is quoted (``tenants['be ta']``),
    and pydantic's ``[key]`` marker, an error in the key itself rather than its
    value, reads `` (key)``.
    """
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "[key]":
            path += " (key)"
        elif not part or any(c.isspace() for c in part):
            path += f"[{part!r}]"
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
            type=PydanticCustomError(error["type"], error["msg"], error.get("ctx")),
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
    model: type[BaseModel] | None = None,
) -> list[ConfigIssue]:
    """Pydantic's errors as issues, noting which value came from the environment.

    With ``model`` (the one validated), an unknown key close to a key of its
    section is told which one was probably meant (``api_key`` for ``api_keys``).

    An environment override wins over the file, so a bad value there looks like
    a bad value in the file; naming the variable saves the operator a search.
    """
    env_names = {name.upper() for name in (os.environ if environ is None else environ)}
    issues = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        message = _plain_message(
            error["type"], error["msg"], error.get("input"), loc, error.get("ctx")
        )
        if error["type"] == "extra_forbidden" and model is not None:
            message += _suggestion(model, loc)
        if env_prefix:
            variable = _env_variable(loc, env_prefix, env_delimiter, env_names)
            if variable is not None:
                message += f" (from environment variable {variable})"
        issues.append(ConfigIssue(format_path(loc), message))
    return issues


#: Pydantic's error types for a value that is not a sequence (the config holds tuples).
_SEQUENCE_TYPES = frozenset({"tuple_type", "list_type", "set_type", "frozen_set_type"})


#: Pydantic's error types for a value that is not a whole number.
_INT_TYPES = frozenset({"int_type", "int_parsing", "int_from_float"})


#: The config's name patterns in words (pydantic quotes the regular expression).
_PATTERNS = {
    r"^[A-Za-z0-9][A-Za-z0-9_.-]*$": (
        "use 1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit"
    ),
    r"^\S(.*\S)?$": "a model name may not start or end with whitespace",
    r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$": "a header name: letters, digits and !#$%&'*+.^_`|~- only",
    r"^[^{}\s]+$": "no '{' or '}' (the proxy adds its own Redis hash tag) and no whitespace",
}


def _plain_message(
    kind: str, message: str, value: object, loc: Loc, ctx: Mapping[str, Any] | None = None
) -> str:
    if kind == "string_pattern_mismatch" and ctx is not None:
        message = _PATTERNS.get(str(ctx.get("pattern")), message)
    if kind == "extra_forbidden":
        return "unknown key"
    if kind in _INT_TYPES and loc and str(loc[-1]).endswith("_ms"):
        message = "input should be a whole number of milliseconds (5 s is 5000)"
    if kind == "missing":
        return "required key is missing"
    secret = any(part in _SECRET_KEYS for part in loc)
    if kind in _SEQUENCE_TYPES:  # pydantic says "tuple": YAML has lists
        message = "input should be a list"
        if isinstance(value, str) and not secret:
            message += f", such as [{value}]"  # one name given where a list is wanted
    if kind != RULE_ERROR_TYPE:
        message = message.removeprefix("Value error, ")
        message = message[:1].lower() + message[1:]
    elif value is None:  # a cross-field rule: its message says it all
        return message
    if isinstance(value, str):
        value = mask_url_password(value)
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


def _suggestion(model: type[BaseModel], loc: Loc) -> str:
    """``"; did you mean 'x'?"`` for the unknown key at ``loc``, or nothing."""
    known = _keys_at(model, loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def _keys_at(model: type[BaseModel], loc: Loc) -> list[str]:
    """The keys of the section at ``loc`` (list indexes and mapping keys stepped over)."""
    annotation: object = model
    for part in loc:
        annotation = _unwrap(annotation)
        origin = typing.get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return []
            annotation = field.annotation
        elif origin is tuple or origin is list:
            annotation = typing.get_args(annotation)[0]
        elif origin is dict:
            annotation = typing.get_args(annotation)[1]
        else:
            return []
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _unwrap(annotation: object) -> object:
    """``X`` of ``X | None`` and of ``Annotated[X, ...]``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin is typing.Union or origin is types.UnionType:
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation
