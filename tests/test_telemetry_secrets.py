"""API keys reach no telemetry: not the access log, spans, /metrics, /admin/config,
error answers, nor the replica.

Keys are sent every way a client may send one (``Authorization: Bearer``,
``X-API-Key``, a URL query string), right and wrong, and on refused requests
too; then every place an operator or an exporter reads is searched for them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from proxy.sim import SimConfig, start_sim
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config
from tests.telemetry_watch import Watch

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
WRONG = "sk-wrong-secret-0123456789"
MSG = [{"role": "user", "content": "hello"}]


async def test_no_key_in_any_telemetry(start_proxy: Start) -> None:
    sim = await start_sim(SimConfig(slots=4, decode_base_ms=1.0))
    try:
        watch = Watch()
        proxy = await start_proxy(make_config([sim.url]), **watch.kwargs())
        watch.proxy = proxy
        await watch.mark()
        body = {"messages": MSG, "max_tokens": 2}
        sends = [
            (CHAT, {"Authorization": f"Bearer {KEY_A}"}, body),
            (CHAT, {"X-API-Key": KEY_A}, {**body, "stream": True}),
            (f"{CHAT}?api_key={KEY_A}", {"Authorization": f"Bearer {KEY_A}"}, body),
            (f"{CHAT}?api_key={WRONG}", {"Authorization": f"Bearer {WRONG}"}, body),
            (CHAT, {"X-API-Key": WRONG}, body),
            (CHAT, {"Authorization": f"Basic {WRONG}"}, body),
            (CHAT, {"Authorization": f"Bearer {KEY_A}", "X-Priority": WRONG}, body),
        ]
        answers = []
        for path, headers, doc in sends:
            resp = await proxy.client.post(path, json=doc, headers=headers)
            answers.append(await resp.text() + str(dict(resp.headers)))
        seen, _, _ = await watch.settle(len(sends))
        config = await (await proxy.client.get("/admin/config")).text()
        metrics = await (await proxy.client.get("/metrics")).text()
        span_text = [
            f"{span.name} {dict(span.attributes or {})} {span.status.description}"
            for one in seen
            for span in one.spans
        ]
        places = {
            "access log": watch.log.getvalue(),
            "spans": "\n".join(span_text),
            "/admin/config": config,
            "/metrics": metrics,
            "answers": "\n".join(answers),
        }
        assert KEY_A in str(sends) and "api_keys" in config  # the search can find them
        for place, text in places.items():
            for key in (KEY_A, WRONG):
                assert key not in text, (place, key)
    finally:
        await sim.close()
