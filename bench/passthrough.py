"""The reference bare pass-through: the least an aiohttp reverse proxy must do.

One shared ``ClientSession`` (its connector sized for the load, not aiohttp's
default of 100); each request's method, path, end-to-end headers and body go
upstream, and the answer's status, end-to-end headers and body come back (an
SSE answer chunk by chunk, as each arrives; any other whole). No
admission, no metrics, no log: it is the baseline this proxy's overhead is
measured against, so it must stay honest and lean.

    python -m bench.passthrough --port 9000 --upstream http://127.0.0.1:9001
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from bench import serving

#: Upstream connections the session may hold at once (far above the benchmark's clients).
CONNECTOR_LIMIT = 1024
#: Hop-by-hop headers (RFC 9110 section 7.6.1), plus the framing aiohttp sets itself.
DROPPED = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "proxy-connection", "host", "content-length"}
)  # fmt: skip
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM: web.AppKey[str] = web.AppKey("upstream", str)


def end_to_end(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in DROPPED)


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    async with request.app[SESSION].request(
        request.method,
        request.app[UPSTREAM] + request.rel_url.raw_path_qs,
        headers=end_to_end(request.headers),
        data=body or None,
        allow_redirects=False,
    ) as upstream:
        headers = end_to_end(upstream.headers)
        if upstream.content_type != "text/event-stream":
            answer = await upstream.read()
            return web.Response(status=upstream.status, headers=headers, body=answer)
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


def build_app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")

    async def session(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CONNECTOR_LIMIT, limit_per_host=0),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    serving.main(__doc__, lambda args: build_app(args.upstream), upstream=True)


if __name__ == "__main__":
    main()
