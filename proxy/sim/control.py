"""Non-generation routes: health, model list, metrics, and the `/sim/*` control plane.

Owns the JSON shapes of `/sim/faults` and `/sim/stats`. Fault changes go
through `SimState.apply_faults`, the one place that validates them; a bad body
is a 400 that names the field, and changes nothing.
"""

from __future__ import annotations

import json
import time

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from proxy.sim.faults import Faults, FaultsError
from proxy.sim.handlers import error_response
from proxy.sim.state import ENGINE_KEY, REGISTRY_KEY, STATE_KEY

__all__ = ["delete_faults", "get_faults", "get_stats", "health", "metrics", "models", "post_faults"]


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    config = request.app[STATE_KEY].config
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "sim",
                    "max_model_len": config.kv_cache_tokens,
                }
            ],
        }
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE_KEY].faults.to_json())


async def post_faults(request: web.Request) -> web.Response:
    """Apply a partial update, e.g. `{"error_rate": 0.5, "error_status": 429}`."""
    try:
        changes = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error_response(400, f"body is not valid JSON: {exc}", "invalid_request_error")
    if not isinstance(changes, dict):
        return error_response(
            400, "body must be a JSON object of fault fields", "invalid_request_error"
        )
    try:
        faults = await request.app[STATE_KEY].apply_faults(changes)
    except FaultsError as exc:
        return error_response(400, str(exc), "invalid_request_error")
    return web.json_response(faults.to_json())


async def delete_faults(request: web.Request) -> web.Response:
    """Switch every fault off (and accept connections again)."""
    faults = await request.app[STATE_KEY].apply_faults(Faults().to_json())
    return web.json_response(faults.to_json())


async def get_stats(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    stats = request.app[ENGINE_KEY].stats()
    return web.json_response(
        {
            "running": stats.running,
            "waiting": stats.waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "completed": stats.completed,
            "aborted": stats.aborted,
            "rejected": stats.rejected,
            "errors_injected": state.dice.errors_injected,
            "resets_injected": state.resets_injected,
            "requests_total": state.requests_total,
            "in_flight": state.in_flight,
            "tokens_generated": stats.tokens_generated,
            "prompt_tokens": stats.prompt_tokens,
            "peak_running": stats.peak_running,
            "peak_waiting": stats.peak_waiting,
            "steps": stats.steps,
            "modelled_busy_s": stats.modelled_busy_s,
        }
    )
