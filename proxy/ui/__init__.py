"""The status page: ``GET /admin/ui`` and the static files beside it.

The page holds no data, so it loads without the admin token (a browser must
be able to open it to type one); every data call it makes (``/admin/state``,
``/admin/history``, drain and undrain) goes through the admin API's rule.
The files ship in the package and are read once, at import. A strict
Content-Security-Policy allows only this origin's script, style and calls,
so nothing inline or from elsewhere can run in an operator's browser.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

from proxy.entrance import expect_continue
from proxy.errors import NotFound

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Wrap = Callable[[Handler, tuple[str, ...] | None], Handler]

_FILES = {
    "app.js": "text/javascript",
    "app.css": "text/css",
    "icon.svg": "image/svg+xml",
}
_TEXT = {name: resources.files(__name__).joinpath(name).read_bytes() for name in _FILES}
_PAGE = resources.files(__name__).joinpath("index.html").read_text("utf-8")

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
}


def add_ui_routes(app: web.Application, wrap: Wrap, open_to: Callable[[web.Request], bool]) -> None:
    """Serve the page and its files (before the admin catch-all route).

    ``open_to(request)``: the admin API would answer this client without a
    token (loopback, no token configured); the page then skips its prompt.
    """

    async def page(request: web.Request) -> web.Response:
        auth = "open" if open_to(request) else "token"
        body = _PAGE.replace("{{auth}}", auth)
        return web.Response(text=body, content_type="text/html", headers=HEADERS)

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in _FILES:
            raise NotFound("no such file")
        return web.Response(
            body=_TEXT[name], content_type=_FILES[name], charset="utf-8", headers=HEADERS
        )

    get = ("GET", "HEAD")
    app.router.add_route("*", "/admin/ui", wrap(page, get), expect_handler=expect_continue)
    app.router.add_route("*", "/admin/ui/{name}", wrap(static, get), expect_handler=expect_continue)
