"""Degrading a request instead of refusing it: its output limit lowered to a cap.

``overload.max_tokens_cap`` (docs/REFERENCE.md, Overload): while a listed
class's budget pressure (``pressure.py``) is above ``overload.at``, each of
its new inference requests asks for at most ``max_tokens_cap`` output
tokens. Shorter answers free their seats sooner, so the class's queue
drains instead of timing out. This module only rewrites the parsed body;
whether to degrade is decided by the entrance, and the answer's
``X-Admission-Degraded: max_tokens`` header by the exchange.

Which field carries the limit:

- OpenAI chat (``/v1/chat/completions``): ``max_completion_tokens`` (the
  newer name) and ``max_tokens`` (the older one, which vLLM, SGLang,
  llama.cpp and TGI all take); each one present above the cap is lowered,
  and when neither is present ``max_tokens`` is inserted, the one every
  engine reads;
- OpenAI completions (``/v1/completions``): ``max_tokens``;
- TGI (``/generate``, ``/generate_stream``): ``parameters.max_new_tokens``;
  SGLang's ``/generate`` (a body with ``text`` or ``input_ids`` and no
  ``inputs``): ``sampling_params.max_new_tokens`` (of each, when it is a
  list: one per prompt of a batch);
- llama.cpp's own API (``/completion``, ``/completions``, ``/infill``):
  ``n_predict`` (its -1, "until the end", counts as absent).

A limit already at or below the cap leaves the body as it is (not
degraded). Embeddings have no output to cap. No I/O.
"""

from __future__ import annotations

from typing import Any

#: What the ``X-Admission-Degraded`` header and the access line's ``degraded`` say.
MAX_TOKENS = "max_tokens"
DEGRADED_HEADER = "X-Admission-Degraded"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TGI = frozenset({"/generate", "/generate_stream"})
LLAMA_CPP = frozenset({"/completion", "/completions", "/infill"})


def _lowered(value: object, cap: int) -> bool:
    """A limit the cap lowers: absent limits are handled by the caller."""
    return not isinstance(value, int) or isinstance(value, bool) or value > cap


def cap_max_tokens(doc: dict[str, Any], route: str, cap: int) -> dict[str, Any] | None:
    """``doc`` with its output limit at most ``cap``; None when nothing changes.

    ``route`` is the normalised path without a trailing slash. A limit that
    is not a positive integer (``null``, a string) counts as absent for the
    engine's default and is replaced by the cap. An ``n_predict`` above the
    cap is lowered on the OpenAI routes too: llama.cpp reads it there and
    takes it over ``max_tokens``, so it would step around the cap.
    """
    capped = _capped_by_route(doc, route, cap)
    if route in LLAMA_CPP or route not in (CHAT, COMPLETIONS):
        return capped
    given = doc.get("n_predict")
    if given is None or (given != -1 and not _lowered(given, cap)):
        return capped
    return {**(capped or doc), "n_predict": cap}


def _capped_by_route(doc: dict[str, Any], route: str, cap: int) -> dict[str, Any] | None:
    if route == CHAT:
        present = [k for k in ("max_completion_tokens", "max_tokens") if doc.get(k) is not None]
        if not present:
            return {**doc, "max_tokens": cap}
        lowered = {k: cap for k in present if _lowered(doc[k], cap)}
        return {**doc, **lowered} if lowered else None
    if route == COMPLETIONS:
        if doc.get("max_tokens") is not None and not _lowered(doc["max_tokens"], cap):
            return None
        return {**doc, "max_tokens": cap}
    if route in TGI:
        sglang = "inputs" not in doc and ("text" in doc or "input_ids" in doc)
        return _capped_in(doc, "sampling_params" if sglang else "parameters", cap)
    if route in LLAMA_CPP:
        given = doc.get("n_predict")
        if given is not None and given != -1 and not _lowered(given, cap):
            return None
        return {**doc, "n_predict": cap}
    return None


def _capped_in(doc: dict[str, Any], nested: str, cap: int) -> dict[str, Any] | None:
    """``doc`` with ``<nested>.max_new_tokens`` at most ``cap`` (TGI's and SGLang's field).

    SGLang takes a list of ``sampling_params`` too, one per prompt of a batch:
    each is capped and keeps its other parameters."""
    params = doc.get(nested)
    if isinstance(params, list) and params and all(isinstance(p, dict) for p in params):
        capped = [_params_capped(p, cap) for p in params]
        if all(c is None for c in capped):
            return None
        return {**doc, nested: [p if c is None else c for p, c in zip(params, capped, strict=True)]}
    capped_one = _params_capped(params if isinstance(params, dict) else {}, cap)
    return None if capped_one is None else {**doc, nested: capped_one}


def _params_capped(params: dict[str, Any], cap: int) -> dict[str, Any] | None:
    given = params.get("max_new_tokens")
    if given is not None and not _lowered(given, cap):
        return None
    return {**params, "max_new_tokens": cap}
