"""Prefix affinity: send requests that share a prompt prefix to the same replica.

An engine's prefix cache (vLLM automatic prefix caching, SGLang's radix tree,
llama.cpp's slot cache) only hits when the request lands where its prefix was
computed before; least-loaded routing scatters a session's turns over the pool
and pays the full prefill every time. Here a request gets an *affinity key*
(the ``routing.affinity_header`` value when the client sends one, else a hash
of the first ``affinity_prefix_chars`` characters of its prompt) and the key
picks a replica on a consistent-hash ring, with bounded loads (Mirrokni,
Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018):

- a replica joining or leaving moves only about ``1/n`` of the keys, so a
  scale-out or an ejection does not cold-start every cache;
- a hot key (one popular system prompt) cannot pile onto one replica: a
  replica whose load after taking the request would exceed
  ``max_load_factor`` times the pool's mean load (each replica's load
  counted as if it took the request) is skipped for the next one on the
  ring. The load is weighted: the caller passes each replica's pending
  prompt work and the request's own work on each (``prefill.py``: small
  where its prefix is cached, its whole prompt where not), so a replica busy
  with a cold prefill is loaded while one running cached turns is not, and a
  spill to a replica where the prompt is cold is counted at its full price;
- a replica the caller cannot use (ejected, draining, no free seat) is
  skipped the same way; when none fits, ``choose`` returns ``None`` and the
  caller falls back to least-loaded.

Only the hash is kept: ``affinity_key`` returns a 64-bit integer and nothing
here stores prompt text or header values. No I/O; the caller owns the ring
(one for the fleet, which a pool walks over its own members: a replica's
points depend on its name only, so that is the pool's own ring).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NewType

#: A 64-bit hash of a request's affinity key: the only thing ever kept.
AffinityKey = NewType("AffinityKey", int)

#: Points per replica on the ring: enough that shares differ by a few percent.
DEFAULT_VIRTUAL_NODES = 160
#: Roles hashed before the others, whatever their position in ``messages``.
_LEADING_ROLES = ("system", "developer")
#: Separates fields so that ("ab", "c") and ("a", "bc") hash differently.
_SEPARATOR = "\x1f"


def _hash(tag: bytes, data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(tag + data, digest_size=8).digest(), "big")


def affinity_key(
    body: object, headers: Mapping[str, str], *, header: str, prefix_chars: int
) -> AffinityKey | None:
    """The request's affinity key, or ``None`` when it has neither header nor prompt.

    ``header`` is matched case-insensitively. The prompt is, for chat, the
    conversation's head: the system and developer messages, then every
    message up to and including the first user message (role and text, text
    parts of multi-part content in order); for completions the ``prompt``
    (the first of a list; token ids as their decimal text); for TGI ``inputs``.

    Why the head and not the whole conversation: each turn of a chat repeats
    the turns before it and adds to them, so a key over everything up to
    ``prefix_chars`` changed every turn of any conversation shorter than that
    (a short system prompt: most chats), and each turn went to an unrelated
    replica, where its prefix was cold. The head is the same in every turn of
    a session. A completion prompt has no such structure: a client that sends
    a growing prompt keeps its turns together with the affinity header.
    """
    value = _header_value(headers, header)
    if value:
        return AffinityKey(_hash(b"h\0", value.encode("utf-8", "surrogatepass")))
    prefix = prompt_prefix(body, prefix_chars)
    if not prefix:
        return None
    return AffinityKey(_hash(b"p\0", prefix.encode("utf-8", "surrogatepass")))


def _header_value(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is not None:
        return value.strip()
    lowered = name.lower()
    for key, candidate in headers.items():
        if key.lower() == lowered:
            return candidate.strip()
    return None


def prompt_prefix(body: object, limit: int) -> str:
    """The first ``limit`` characters of the prompt text; built lazily, never beyond ``limit``.

    Returned to ``affinity_key`` only, which hashes it at once.
    """
    if not isinstance(body, dict):
        return ""
    out: list[str] = []
    size = 0
    for piece in _prompt_pieces(body):
        out.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return "".join(out)[:limit]


def _prompt_pieces(body: Mapping[str, Any]) -> Iterator[str]:
    messages = body.get("messages")
    if isinstance(messages, list):
        ordered = [m for m in messages if isinstance(m, dict)]
        ordered.sort(key=lambda m: m.get("role") not in _LEADING_ROLES)  # stable
        for message in ordered:
            yield str(message.get("role", "")) + _SEPARATOR
            yield from _content_texts(message.get("content"))
            yield _SEPARATOR
            if message.get("role") == "user":
                return  # the head ends here: later turns must not change the key
        return
    prompt = body.get("prompt", body.get("inputs"))
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
    if isinstance(prompt, str):
        yield prompt
    elif isinstance(prompt, list):  # token ids
        yield ",".join(str(token) for token in prompt if isinstance(token, int))


def _content_texts(content: object) -> Iterator[str]:
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                yield part["text"]
                yield _SEPARATOR


class HashRing:
    """A consistent-hash ring over one pool's replica names, with virtual nodes.

    >>> ring = HashRing(["gpu-0", "gpu-1", "gpu-2"])
    >>> ring.choose(AffinityKey(42), {"gpu-0": 0, "gpu-1": 0, "gpu-2": 0}) in ring.names
    True
    """

    __slots__ = ("_owners", "_points", "names", "virtual_nodes")

    def __init__(self, names: Iterable[str], *, virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        self.names = frozenset(names)
        self.virtual_nodes = virtual_nodes
        ring = sorted(
            (_hash(b"r\0", f"{name}#{i}".encode()), name)
            for name in self.names
            for i in range(virtual_nodes)
        )
        self._points = [point for point, _ in ring]
        self._owners = [name for _, name in ring]

    def __repr__(self) -> str:
        return f"<HashRing {len(self.names)} replicas, {len(self._points)} points>"

    def walk(self, key: AffinityKey) -> Iterator[str]:
        """Distinct replicas clockwise from ``key``'s point: the preferred one first."""
        if not self._points:
            return
        start = bisect_right(self._points, key)
        seen: set[str] = set()
        for step in range(len(self._points)):
            owner = self._owners[(start + step) % len(self._points)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.names):
                    return

    def choose(
        self,
        key: AffinityKey,
        load: Mapping[str, float],
        *,
        eligible: Callable[[str], bool] | None = None,
        max_load_factor: float = 1.25,
        work: Callable[[str], float] | None = None,
    ) -> str | None:
        """The first eligible replica from ``key`` whose load stays within the bound.

        ``load`` is each replica's load now (missing: 0) and ``work(name)`` what
        the request adds there (default 1: loads are request counts). A replica
        fits when ``load + work`` is at most ``max_load_factor`` times the mean of
        ``load + work`` over the eligible replicas. The least of those always
        fits (it is at most the mean), so with ``max_load_factor >= 1`` ``None``
        means none is eligible. With request counts the chosen replica's count,
        the request included, stays within ``max_load_factor * (mean + 1)``.
        """
        usable = [name for name in self.names if eligible is None or eligible(name)]
        if not usable:
            return None
        after = {
            name: load.get(name, 0.0) + (1.0 if work is None else work(name)) for name in usable
        }
        bound = max_load_factor * sum(after.values()) / len(usable) * (1.0 + 1e-9)
        for name in self.walk(key):
            if name in after and after[name] <= bound:
                return name
        return None
