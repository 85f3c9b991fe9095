"""Typed application keys (aiohttp ``AppKey``), shared by the app's modules."""

from __future__ import annotations

from aiohttp import web

from proxy.runtime import Runtime
from proxy.telemetry.history import History

RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)
HISTORY: web.AppKey[History] = web.AppKey("history", History)
