"""The request path as the proxy judges it and forwards it: one normal form, one allow-list.

A path is normalised once, at the entrance, and that one string is then used
for every decision (inference route, seatless, allow-list, reserved) and sent
to the replica. Judging one path and forwarding another is how
``/x/../v1/chat/completions`` used to skip the inference checks yet reach the
inference route, and how ``/v1/../../secret`` climbed out of a replica's URL
prefix once the HTTP client collapsed the dots after joining.

The rules (RFC 3986 section 6.2.2, made strict where readings differ):

- only visible ASCII; a backslash, an encoded slash (``%2F``) or backslash
  (``%5C``), an encoded control character, a malformed ``%`` escape and an
  empty segment (``//``) are refused, since engines and the servers in front
  of them disagree on what those mean;
- the one exception is a model id under ``/v1/models/``: Hugging Face names
  hold a slash (``meta-llama/Llama-3.1-8B``) and the OpenAI client sends
  ``models.retrieve`` of one as ``%2F``. There the escape is decoded to ``/``
  (so the proxy and a replica both see the same segments), and the result
  must still lie under ``/v1/models/``;
- percent-encoded unreserved characters are decoded (``%2e`` is ``.``,
  ``%61`` is ``a``); other escapes are kept as sent;
- ``.`` and ``..`` segments are resolved; a ``..`` that would climb above
  the root is refused rather than clipped.

The query string is not touched, only refused when it holds a character
outside visible ASCII (``checked_query``). Nothing here does I/O; the common
path (no ``%``, no dot segment, no ``//``) costs a few substring scans.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from proxy.errors import BadRequest

#: Answered by the proxy itself, never forwarded, whatever ``routes`` says
#: (each with everything below it: ``/admin/...``, ``/healthz/x``).
RESERVED = frozenset({"/healthz", "/readyz", "/metrics", "/admin"})

#: Visible ASCII, the only bytes a raw path may hold (``%`` escapes aside).
_VISIBLE = re.compile(r"[!-~]*")
_ESCAPE = re.compile(r"%(?P<hex>[0-9A-Fa-f]{2})")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
#: Escapes that stay refused even when well formed: a slash or a backslash
#: (a segment boundary some servers see and others do not).
_REFUSED_ESCAPES = frozenset({"2F", "5C"})
#: Below this prefix an encoded slash is part of a model id (see the module's rules).
MODEL_ID_PREFIX = "/v1/models/"


def normalise_path(raw: str) -> str:
    """The path to judge and forward, or ``BadRequest``; ``raw`` is the path as sent."""
    if raw[:1] != "/":
        raise BadRequest("the request target must be an absolute path")
    # Visible ASCII is printable ASCII but the space (which the HTTP parser
    # never leaves in a target anyway); each test is one C-level scan.
    if (
        "%" in raw
        or "/." in raw
        or "//" in raw
        or "\\" in raw
        or not (raw.isascii() and raw.isprintable())
        or " " in raw
    ):
        return _normalise(raw)
    return raw  # nothing to resolve: the common case


def checked_query(raw: str) -> str:
    """The query string, forwarded as sent, or ``BadRequest`` when it holds a
    character outside visible ASCII.

    aiohttp's C parser refuses such a request target outright; its pure-Python
    one lets the raw bytes through, and a byte that is not UTF-8 then cannot
    be written to the replica (a 500). Refused here, the two parsers agree.
    """
    if raw and not (raw.isascii() and raw.isprintable() and " " not in raw):
        raise BadRequest("the query string holds a character outside visible ASCII")
    return raw


def _normalise(raw: str) -> str:
    if not _VISIBLE.fullmatch(raw):
        raise BadRequest("the path holds a character outside visible ASCII")
    if "\\" in raw:
        raise BadRequest("the path holds a backslash")
    slashes = False
    if "%" in raw:
        slashes = raw.startswith(MODEL_ID_PREFIX) and "%2F" in raw.upper()
        raw = _decode_unreserved(raw, slashes=slashes)
    segments = raw.split("/")[1:]
    out: list[str] = []
    for i, segment in enumerate(segments):
        last = i == len(segments) - 1
        if segment == ".":
            if last:
                out.append("")  # "/a/." is "/a/"
        elif segment == "..":
            if not out:
                raise BadRequest("the path climbs above the root with '..'")
            out.pop()
            if last:
                out.append("")  # "/a/b/.." is "/a/"
        elif segment == "" and not last:
            raise BadRequest("the path holds an empty segment ('//')")
        else:
            out.append(segment)
    path = "/" + "/".join(out)
    if slashes and not path.startswith(MODEL_ID_PREFIX):
        raise BadRequest("the path climbs out of /v1/models/ with an encoded slash")
    return path


def _decode_unreserved(raw: str, *, slashes: bool = False) -> str:
    """Unreserved escapes decoded, others kept; malformed or refused escapes raise.
    With ``slashes`` (a model id's path) ``%2F`` is decoded to ``/``."""
    if raw.count("%") != len(_ESCAPE.findall(raw)):
        raise BadRequest("the path holds a malformed percent escape")

    def decode(match: re.Match[str]) -> str:
        code = match["hex"].upper()
        if slashes and code == "2F":
            return "/"
        if code in _REFUSED_ESCAPES:
            raise BadRequest("the path holds an encoded slash or backslash")
        char = chr(int(code, 16))
        if char in _UNRESERVED:
            return char
        if int(code, 16) < 0x20 or code == "7F":
            raise BadRequest("the path holds an encoded control character")
        return match[0]

    return _ESCAPE.sub(decode, raw)


def reserved(path: str) -> bool:
    """Whether ``path`` (normalised) is one of the proxy's own or below one."""
    cut = path.find("/", 1)
    return (path if cut < 0 else path[:cut]) in RESERVED


def forwardable(path: str, routes: Collection[str]) -> bool:
    """Whether ``path`` (normalised) may go to a replica: under a route, not reserved.

    A path that is a route itself is one set lookup: entries are never
    reserved paths (``route_problem``), and ``/``, which opens every path,
    is not one either.
    """
    if path in routes:
        return True
    return not reserved(path) and route_allowed(path, routes)


def route_allowed(path: str, routes: Collection[str]) -> bool:
    """Whether a route (a path prefix, matched by whole segments) lets ``path`` through.

    ``/v1/models`` lets ``/v1/models`` and ``/v1/models/x`` through, not
    ``/v1/modelsx``; ``/`` lets everything through. One set lookup when the
    path is a route itself (the common case), one per segment otherwise.
    """
    if path in routes:
        return True
    prefix = path
    while (cut := prefix.rfind("/")) > 0:
        prefix = prefix[:cut]
        if prefix in routes:
            return True
    return "/" in routes


def route_problem(route: str) -> str | None:
    """Why ``route`` cannot be a ``routes`` entry, or None: entries are normalised prefixes."""
    if not route.startswith("/"):
        return 'must start with "/"'
    if not re.fullmatch(r"/[A-Za-z0-9\-._~!$&'()*+,;=:@/]*", route):
        return "may hold only letters, digits, '/' and -._~!$&'()*+,;=:@ (no %, ? or #)"
    if route != "/" and route.endswith("/"):
        return 'must not end with "/" (a route covers every path below it)'
    if "//" in route or any(s in (".", "..") for s in route.split("/")):
        return "must be a normalised path (no '//', '.' or '..' segments)"
    if reserved(route):
        return "is a path the proxy answers itself; it is never forwarded"
    return None
