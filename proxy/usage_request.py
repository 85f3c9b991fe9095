"""Asking the engine for a stream's usage the client did not ask for.

A tenant with a token quota is charged the real usage of its streams. An
OpenAI-style engine (vLLM, SGLang, llama.cpp, OpenAI itself) reports it only
when the request says ``stream_options: {include_usage: true}``; this is the
one place the proxy adds that to a body. The relay then removes what it
added from the client's stream (``sse_usage.UsageStripper``), so the client
gets the bytes it would have got without it. Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Any

#: Routes whose streams report usage when asked with ``stream_options``.
USAGE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})


def request_usage(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The body with ``include_usage`` set, or None when nothing needs adding.

    None for a request that is not a stream, that already asked for usage
    (the client then gets the usage chunk it asked for), or whose
    ``stream_options`` is not an object (the engine judges that body as sent).
    """
    if doc.get("stream") is not True:
        return None
    options = doc.get("stream_options")
    if options is None:
        return {**doc, "stream_options": {"include_usage": True}}
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return None
    # vLLM's ``continuous_usage_stats`` does nothing without ``include_usage``; with
    # it, every chunk would carry a usage object the client never got before.
    kept = {key: value for key, value in options.items() if key != "continuous_usage_stats"}
    return {**doc, "stream_options": {**kept, "include_usage": True}}
