"""Which routes the proxy reads a body on, and what a body says of its output.

Three sets, each for one reason:

- ``INFERENCE_PATHS``: the contract's inference routes (docs/REFERENCE.md,
  Retry classes). Their body must be a JSON object (else 400) and a repeat
  is safe, so every configured retry class applies to them.
- ``NATIVE_GENERATION_PATHS``: llama.cpp's own generation API
  (``/completion``, its alias ``/completions``, ``/infill``). An engine
  generates there as on ``/v1/completions``, so the body is read for
  ``stream``, the output limit (``n_predict``) and token quotas; it is not an
  inference route, so a body that is not JSON is forwarded as before (the
  engine judges it) and only connection failures are retried.
- ``PROMPT_ONLY_PATHS``: routes that read a prompt and generate nothing
  (embeddings, reranking, in their OpenAI and llama.cpp spellings). Charged
  their prompt alone.

``METERED_PATHS`` is their union: a tenant's token quota counts every route
where an engine spends tokens, so moving a workload from ``/v1/completions``
to llama.cpp's ``/completion`` cannot step around it.
"""

from __future__ import annotations

from typing import Any

INFERENCE_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/generate", "/generate_stream"}
)
NATIVE_GENERATION_PATHS = frozenset({"/completion", "/completions", "/infill"})
PROMPT_ONLY_PATHS = frozenset(
    {"/v1/embeddings", "/embedding", "/embeddings", "/v1/rerank", "/rerank"}
)
METERED_PATHS = INFERENCE_PATHS | NATIVE_GENERATION_PATHS | PROMPT_ONLY_PATHS
#: The most output tokens a request is counted for, whatever it names: more than any
#: token quota holds. A JSON number may have 4,300 digits, and the product of two
#: (``max_tokens`` times ``n``) has more than Python writes as text (the quota's
#: refusal message, the Redis store's arguments); the Redis store's Lua numbers are
#: doubles, exact up to here.
MAX_OUTPUT_LIMIT = 2**53


def route_of(path: str) -> str:
    """``/v1/chat/completions/`` is judged as the route it may well reach."""
    return path[:-1] if path.endswith("/") and len(path) > 1 else path


def _positive(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def output_limit(doc: Any) -> int | None:
    """The most tokens the request may generate, by the fields its API names it with.

    OpenAI's ``max_tokens`` / ``max_completion_tokens``, TGI's
    ``parameters.max_new_tokens``, SGLang's ``sampling_params.max_new_tokens``,
    llama.cpp's ``n_predict``; the largest when several are given, since
    engines differ in which one wins (llama.cpp takes ``n_predict`` over
    ``max_tokens``, on every route): a ``max_tokens`` of 1 beside an
    ``n_predict`` of thousands was charged 1. A negative ``n_predict``
    (llama.cpp's "until the end") names no limit even beside ``max_tokens``,
    which llama.cpp then ignores: charging the ``max_tokens`` undercharged an
    answer that runs to the context's end.
    Times the sequences it asks for (``sequences``). SGLang's list of
    ``sampling_params`` (one per prompt of a batch) is summed. None when it
    names no limit: the caller then uses the tenant's recent mean output,
    which already counts the choices such a tenant asks for. At most
    ``MAX_OUTPUT_LIMIT``.
    """
    if not isinstance(doc, dict):
        return None
    sampling = doc.get("sampling_params")
    if isinstance(sampling, list):
        return _per_prompt(sampling)
    n_predict = doc.get("n_predict")
    if isinstance(n_predict, int) and not isinstance(n_predict, bool) and n_predict < 0:
        return None
    named = [doc.get("max_tokens"), doc.get("max_completion_tokens"), n_predict]
    for params in (doc.get("parameters"), sampling):
        if isinstance(params, dict):
            named.append(params.get("max_new_tokens"))
    limits = [limit for value in named if (limit := _positive(value)) is not None]
    return min(MAX_OUTPUT_LIMIT, max(limits) * sequences(doc)) if limits else None


def _per_prompt(sampling: list[Any]) -> int | None:
    """SGLang's batch with its own ``sampling_params`` per prompt: the sum of each
    one's ``max_new_tokens`` times its ``n``; None unless each names a limit."""
    total = 0
    for params in sampling:
        limit = _positive(params.get("max_new_tokens")) if isinstance(params, dict) else None
        if limit is None:
            return None
        total += limit * (_positive(params.get("n")) or 1)
    return min(MAX_OUTPUT_LIMIT, total) or None


def sequences(doc: dict[str, Any]) -> int:
    """How many sequences the engine generates for one request: OpenAI's ``n``,
    vLLM's ``best_of`` (it generates that many and returns ``n``), TGI's
    ``parameters.best_of``, SGLang's ``sampling_params.n`` (the largest, at
    least 1), for each prompt of a batch (``prompts``)."""
    counts = [_positive(doc.get("n")), _positive(doc.get("best_of"))]
    for nested, key in (("parameters", "best_of"), ("sampling_params", "n")):
        params = doc.get(nested)
        if isinstance(params, dict):
            counts.append(_positive(params.get(key)))
    return max([1, *(count for count in counts if count is not None)]) * prompts(doc)


def samples_per_prompt(doc: Any) -> int:
    """Answers SGLang's own API generates per prompt: ``sampling_params.n`` (one
    per prompt in a list, where SGLang requires them all equal), at least 1.

    Only SGLang's API answers each of them with its own copy of the prompt's
    count (OpenAI's ``n`` gets one ``usage``), so only it is read here.
    """
    if not isinstance(doc, dict):
        return 1
    sampling = doc.get("sampling_params")
    if isinstance(sampling, list):
        sampling = sampling[0] if sampling else None
    if isinstance(sampling, dict):
        return _positive(sampling.get("n")) or 1
    return 1


def prompts(doc: dict[str, Any]) -> int:
    """How many prompts one request carries: a batch is a list of them in
    ``prompt`` (OpenAI and llama.cpp completions), SGLang's ``text`` or
    ``input_ids``; each is answered with its own output. A list that holds a
    number at its top is one prompt (token ids, or llama.cpp's mix of token
    ids and text), as the engines read it. At least 1."""
    for key in ("prompt", "text", "input_ids"):
        given = doc.get(key)
        if isinstance(given, list) and given:
            single = any(isinstance(item, int) for item in given)
            return 1 if single else len(given)
    return 1
