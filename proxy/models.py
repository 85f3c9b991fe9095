"""Model pools as pure data: which replicas serve which model, and who may use it.

Real fleets serve several models (and LoRA adapters) behind one gateway, so a
request must wait for a seat on a replica that serves *its* model. This module
holds the bookkeeping, with no I/O: the health prober parses each replica's
``GET /v1/models`` with ``parse_model_list`` and feeds the result to
``ModelTable.update``; the entrance asks ``ModelTable.select`` which pool a
body's ``model`` names (or why it is refused); ``GET /v1/models`` answers
``ModelTable.list_response``.

Rules the contract left open, decided here:

- **Static beats discovered.** A replica whose ``models`` is configured never
  changes its membership from discovery; one with ``models: null`` serves
  whatever its last parsable ``/v1/models`` listed (nothing before the first,
  or its former static list when a reload turned it to ``null``).
  An unparsable answer keeps the last known set: a garbled probe must not
  empty a pool.
- **Aliases are one step.** ``model_aliases`` maps a client-facing name to a
  served one; an alias naming another alias is a config error, and so is an
  alias that shadows a model some replica lists statically. A *discovered*
  model that has the same name as an alias wins at run time (a name a replica
  really serves is never redirected); ``ModelTable.shadowed_aliases`` reports
  it so the operator can be told.
- **Access is to models, names are handles.** ``allowed_models`` may list
  models and aliases; a tenant may use a name when the model it resolves to is
  the resolution of an allowed entry. Allowing ``llama-8b`` therefore allows
  every alias of it, and allowing only the alias ``gpt-4o-mini`` also allows
  its target's own name.
- **Order of refusals**: a ``model`` that is not a string is 400
  ``bad_request``; a name no replica serves (after aliasing) is 404
  ``model_not_found``; a served model the tenant may not use is 403
  ``model_not_allowed``. Without ``model``, the only pool when exactly one
  exists, else 400 ``bad_request``. (Before any replica has listed a model
  the entrance answers 503 ``no_healthy_replica`` instead of asking here.)
"""

from __future__ import annotations

import json
from collections.abc import Collection, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from proxy.errors import BadRequest, ModelNotAllowed, ModelNotFound, Rejected

#: ``owned_by`` of the proxy's own ``/v1/models`` entries.
OWNED_BY = "admission-proxy"

RefusalReason = Literal["bad_request", "model_not_found", "model_not_allowed"]
_REFUSALS: Mapping[str, type[Rejected]] = {
    "bad_request": BadRequest,
    "model_not_found": ModelNotFound,
    "model_not_allowed": ModelNotAllowed,
}


def parse_model_list(body: bytes | str) -> frozenset[str] | None:
    """The model ids of an OpenAI-style ``/v1/models`` answer; ``None`` when unparsable.

    vLLM, SGLang, llama.cpp and TGI all answer ``{"object": "list", "data":
    [{"id": ...}, ...]}``; vLLM lists each LoRA adapter as its own entry (with
    ``parent`` naming the base), so adapters become pools like base models.
    Any malformed entry makes the whole answer unparsable rather than silently
    dropping one model from its pool.
    """
    document = _json(body)
    if not isinstance(document, dict):
        return None
    data = document.get("data")
    if not isinstance(data, list):
        return None
    names: set[str] = set()
    for entry in data:
        if not isinstance(entry, dict):
            return None
        name = entry.get("id")
        if not isinstance(name, str) or not name.strip():
            return None
        names.add(name)
    return frozenset(names)


def parse_tgi_info(body: bytes | str) -> frozenset[str] | None:
    """The one model of a TGI ``GET /info`` answer (``model_id``); ``None`` when unparsable."""
    document = _json(body)
    if not isinstance(document, dict):
        return None
    name = document.get("model_id")
    if not isinstance(name, str) or not name.strip():
        return None
    return frozenset({name})


def _json(body: bytes | str) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def static_models(replicas: Iterable[ServesModels] | None) -> set[str] | None:
    """Every model the replicas list, when *all* of them list ``models``; else None.

    With one replica discovering its models (``GET /v1/models``), any name
    may appear later (a LoRA adapter loaded at run time), so config rules
    that need the full list are skipped.
    """
    listed = list(replicas or ())
    if not listed or any(replica.models is None for replica in listed):
        return None
    return {model for replica in listed for model in replica.models or ()}


def allowed_model_problems(
    allowed: Iterable[str], aliases: Container[str], static: Collection[str] | None
) -> list[tuple[int, str]]:
    """A tenant's ``allowed_models`` entries that no replica lists and no alias names,
    as ``(index, message)``; none when some replica discovers its models (``static``
    None). Such an entry admits nothing: the tenant would get 404 for it forever."""
    if static is None:
        return []
    served = ", ".join(sorted(static))
    return [
        (i, f"{name!r} is neither a model a replica lists nor an alias (models listed: {served})")
        for i, name in enumerate(allowed)
        if name not in static and name not in aliases
    ]


def alias_problems(
    aliases: Mapping[str, str], static_models: Collection[str] | None
) -> list[tuple[tuple[str, ...], str]]:
    """Config problems of ``model_aliases`` as ``(loc, message)`` pairs under that key.

    ``static_models`` is every model the replicas list when *all* of them list
    ``models``; ``None`` when some replica discovers its models, in which case
    a target may appear later and only the shape of the table is checked.
    """
    problems: list[tuple[tuple[str, ...], str]] = []
    for alias, target in aliases.items():
        if alias == target:
            problems.append(((alias,), "an alias may not name itself"))
        elif target in aliases:
            message = f"{target!r} is itself an alias: aliases are one step, name its target"
            problems.append(((alias,), message))
        elif static_models is not None and alias in static_models:
            message = "shadows a model a replica lists in models: clients could not reach it"
            problems.append(((alias,), message))
        elif static_models is not None and target not in static_models:
            served = ", ".join(sorted(static_models))
            message = f"{target!r} is not served by any replica (models listed: {served})"
            problems.append(((alias,), message))
    return problems


class ServesModels(Protocol):
    """What the table needs of a replica's config (``settings.ReplicaConfig``)."""

    @property
    def name(self) -> str: ...

    @property
    def models(self) -> tuple[str, ...] | None: ...


@dataclass(frozen=True, slots=True)
class PoolChoice:
    """The pool a request goes to: the served model and the replicas that serve it."""

    model: str
    replicas: frozenset[str]


@dataclass(frozen=True, slots=True)
class ModelRefusal:
    """Why a request names no usable pool; ``error()`` is what the entrance raises."""

    reason: RefusalReason
    message: str

    def error(self) -> Rejected:
        return _REFUSALS[self.reason](self.message)


class ModelTable:
    """Model name to replica names, from static ``models`` and per-replica discovery.

    >>> table = ModelTable({"gpu-0": ("llama-8b",), "gpu-1": None}, {"mini": "llama-8b"})
    >>> table.update("gpu-1", frozenset({"qwen-7b"}))
    True
    >>> table.select("mini", allowed=None)
    PoolChoice(model='llama-8b', replicas=frozenset({'gpu-0'}))
    """

    __slots__ = ("_aliases", "_served", "_static", "restricted")

    def __init__(
        self, replicas: Mapping[str, Iterable[str] | None], aliases: Mapping[str, str]
    ) -> None:
        self._static = frozenset(name for name, models in replicas.items() if models is not None)
        self._served: dict[str, frozenset[str]] = {
            name: frozenset(models or ()) for name, models in replicas.items()
        }
        self._aliases = dict(aliases)
        #: Some tenant has ``allowed_models``: the body's ``model`` must be checked.
        self.restricted = False

    @property
    def pooled(self) -> bool:
        """Whether requests are routed by model at all.

        Not when no replica lists ``models``, no alias and no ``allowed_models``
        is configured, and discovery has found at most one model: the common
        single-model deployment. Then every replica (its models known or not)
        is the one implicit pool, bodies go upstream unchanged and ``GET
        /v1/models`` is the replica's own answer, exactly as without pools.
        """
        return bool(
            self._static or self._aliases or self.restricted or len(self.served_models()) > 1
        )

    def reconfigure(
        self,
        replicas: Mapping[str, Iterable[str] | None],
        aliases: Mapping[str, str],
        *,
        restricted: bool,
    ) -> None:
        """A reloaded config: static lists and aliases replaced, discoveries kept.

        A replica that turns from static to discovered keeps its static list as
        its last known set until its own ``GET /v1/models`` answers (its next
        probe), rather than discover at once on reload: nothing it served a
        moment ago is refused meanwhile, and a replica that cannot answer is no
        worse off than before the reload. A replica gone from the config is
        forgotten.
        """
        served: dict[str, frozenset[str]] = {}
        for name, models in replicas.items():
            if models is not None:
                served[name] = frozenset(models)
            else:
                served[name] = self._served.get(name, frozenset())
        self._static = frozenset(name for name, models in replicas.items() if models is not None)
        self._served = served
        self._aliases = dict(aliases)
        self.restricted = restricted

    @classmethod
    def from_config(
        cls, replicas: Iterable[ServesModels], aliases: Mapping[str, str]
    ) -> ModelTable:
        """The table of a config's ``replicas`` and ``model_aliases``, before any discovery."""
        return cls({replica.name: replica.models for replica in replicas}, aliases)

    def discovers(self, replica: str) -> bool:
        """Whether the prober asks this replica's ``GET /v1/models`` (no static list)."""
        return replica not in self._static

    def target_of(self, name: str) -> str | None:
        """The served model an alias stands for, ``None`` when ``name`` is no alias in use."""
        resolved = self.resolve(name)
        return resolved if resolved != name else None

    def __repr__(self) -> str:
        pools = ", ".join(
            f"{model}: {len(self.pool(model))}" for model in sorted(self.served_models())
        )
        return f"<ModelTable {len(self._served)} replicas, {len(self._aliases)} aliases; {pools}>"

    def update(self, replica: str, models: frozenset[str] | None) -> bool:
        """A replica's discovered models; ``True`` when its membership changed.

        Ignored (``False``) for a replica with static ``models``, for ``None``
        (an unparsable answer keeps the last known set), and for a replica the
        config does not list: a reload's removed replica is still probed while
        its last requests drain, and its answer must not put back the pool the
        reload took away (nothing would ever take it out again).
        """
        if models is None or replica in self._static or replica not in self._served:
            return False
        changed = self._served.get(replica) != models
        self._served[replica] = models
        return changed

    def forget(self, replica: str) -> bool:
        """Drop a replica (removed by a reload); ``True`` when it served anything."""
        return bool(self._served.pop(replica, frozenset()))

    def models_of(self, replica: str) -> frozenset[str]:
        return self._served.get(replica, frozenset())

    def served_models(self, healthy: Container[str] | None = None) -> frozenset[str]:
        """Every model some replica serves (only the ``healthy`` ones when given)."""
        return frozenset(
            model
            for replica, models in self._served.items()
            if healthy is None or replica in healthy
            for model in models
        )

    def resolve(self, name: str) -> str:
        """The served name behind ``name``: a served model is itself, else its alias target."""
        if name in self.served_models():
            return name
        return self._aliases.get(name, name)

    def shadowed_aliases(self) -> frozenset[str]:
        """Aliases that a discovered model of the same name makes unreachable."""
        return frozenset(self._aliases) & self.served_models()

    def aliases_of(self, model: str) -> list[str]:
        """The aliases that reach ``model`` (shadowed ones left out), sorted."""
        shadowed = self.shadowed_aliases()
        return sorted(a for a, t in self._aliases.items() if t == model and a not in shadowed)

    def pool(self, model: str) -> frozenset[str]:
        """Replicas serving ``model`` (after alias resolution), healthy or not."""
        served = self.resolve(model)
        return frozenset(r for r, models in self._served.items() if served in models)

    def allows(self, allowed: Iterable[str] | None, name: str) -> bool:
        """Whether a tenant with ``allowed_models`` may use ``name`` (see the module rules)."""
        if allowed is None:
            return True
        return self.resolve(name) in {self.resolve(entry) for entry in allowed}

    def select(self, model: object, *, allowed: Iterable[str] | None) -> PoolChoice | ModelRefusal:
        """The pool for a body's ``model`` value (``None`` when the field is absent)."""
        if model is None:
            served = self.served_models()
            if len(served) != 1:
                message = "the request names no model: set model to one GET /v1/models lists"
                return ModelRefusal("bad_request", message)
            (model,) = served
        if not isinstance(model, str):
            return ModelRefusal("bad_request", "model must be a string")
        replicas = self.pool(model)
        if not replicas:
            # Never the name itself: answers echo nothing the client sent.
            return ModelRefusal("model_not_found", "the requested model does not exist")
        if not self.allows(allowed, model):
            return ModelRefusal("model_not_allowed", "this key may not use the requested model")
        return PoolChoice(self.resolve(model), replicas)

    def models_for_tenant(
        self, allowed: Iterable[str] | None, healthy: Container[str] | None = None
    ) -> list[str]:
        """Names a tenant may send, sorted: served models of healthy replicas plus their aliases."""
        allowed = None if allowed is None else tuple(allowed)
        served = self.served_models(healthy)
        names = set(served)
        shadowed = self.shadowed_aliases()
        names.update(
            a for a, target in self._aliases.items() if target in served and a not in shadowed
        )
        return sorted(name for name in names if self.allows(allowed, name))

    def list_response(
        self, allowed: Iterable[str] | None, healthy: Container[str] | None = None
    ) -> dict[str, Any]:
        """``GET /v1/models`` for a tenant, in OpenAI's list format."""
        data = [_model_object(name) for name in self.models_for_tenant(allowed, healthy)]
        return {"object": "list", "data": data}

    def model_response(
        self, name: str, allowed: Iterable[str] | None, healthy: Container[str] | None = None
    ) -> dict[str, Any] | None:
        """``GET /v1/models/{name}``: its entry of the tenant's list; ``None`` when the
        list has no such name (unknown, not served now, or not allowed: all one 404,
        so a tenant cannot probe which models exist beyond its own)."""
        if name not in self.models_for_tenant(allowed, healthy):
            return None
        return _model_object(name)


def _model_object(name: str) -> dict[str, Any]:
    """OpenAI's model object, as ``GET /v1/models`` lists it."""
    return {"id": name, "object": "model", "created": 0, "owned_by": OWNED_BY}
