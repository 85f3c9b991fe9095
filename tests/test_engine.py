"""The proxy in front of two real ``llama-server`` replicas (``--parallel 2``).

Everything the simulator tests show, shown again against an engine we did
not write: its OpenAI API through the official client, its unbounded queue
kept empty by the proxy's seats, fairness, cancellation of an abandoned
stream, a crash and restart, and timing that agrees with the engine's own.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.real_engine import Engine
from proxy.settings import Config
from tests.conftest import ProxyUnderTest
from tests.engine import MODEL, LlamaServer, llama_servers
from tests.helpers import KEY_A, KEY_B, make_config, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.timeout(180)]

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
MSG: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a story about a lighthouse keeper."}
]
EQUAL_TENANTS = {
    "a": {"api_keys": [KEY_A], "priority": "standard"},
    "b": {"api_keys": [KEY_B], "priority": "standard"},
}


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    """A chat request that generates exactly ``max_tokens`` tokens (random weights)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": MSG,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def engine_config(servers: list[LlamaServer], **sections: Any) -> Config:
    """One seat per engine slot, engine metrics read, fast health rounds."""
    sections.setdefault("health", {"interval_ms": 100})
    replicas = [
        {
            "name": f"r{i}",
            "url": s.url,
            "max_concurrency": s.parallel,
            "metrics_url": s.url + "/metrics",
        }
        for i, s in enumerate(servers)
    ]
    return make_config([s.url for s in servers], replicas=replicas, **sections)


async def engine_gauges(session: aiohttp.ClientSession, server: LlamaServer) -> dict[str, float]:
    """The engine's /metrics by name, read without blocking the proxy's loop."""
    async with session.get(server.url + "/metrics") as response:
        text = await response.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def engines_idle(servers: list[LlamaServer], timeout_s: float = 10.0) -> None:
    """Until no engine runs or queues anything: an earlier test's abandoned requests
    (non-streamed ones are cancelled about a second late) must not count here."""
    async with aiohttp.ClientSession() as session, asyncio.timeout(timeout_s):
        while True:
            busy = 0.0
            for server in servers:
                gauges = await engine_gauges(session, server)
                busy += gauges["llamacpp:requests_processing"]
                busy += gauges["llamacpp:requests_deferred"]
            if not busy:
                return
            await asyncio.sleep(0.02)


class Sampler:
    """Polls every engine's gauges (and optionally the proxy's queue) until stopped."""

    def __init__(self, servers: list[LlamaServer], proxy: ProxyUnderTest | None = None) -> None:
        self.servers = servers
        self.proxy = proxy
        self.max_deferred = 0.0
        self.max_processing = 0.0
        self.max_queued = 0
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                for server in self.servers:
                    gauges = await engine_gauges(session, server)
                    self.max_deferred = max(self.max_deferred, gauges["llamacpp:requests_deferred"])
                    self.max_processing = max(
                        self.max_processing, gauges["llamacpp:requests_processing"]
                    )
                if self.proxy is not None:
                    queued = self.proxy.runtime.dispatcher.queued()
                    self.max_queued = max(self.max_queued, queued)
                self.samples += 1
                await asyncio.sleep(0.01)

    def __enter__(self) -> Sampler:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def read_sse(response: aiohttp.ClientResponse) -> tuple[list[dict[str, Any]], bool]:
    """Every JSON event of a stream, and whether it ended with ``[DONE]``."""
    events: list[dict[str, Any]] = []
    done = False
    async for raw in response.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
    return events, done


# -- the official client -------------------------------------------------------------------


async def test_openai_client_chat_and_completions_streaming_and_not(
    start_proxy: Start, llama_pair: list[LlamaServer]
) -> None:
    proxy = await start_proxy(engine_config(llama_pair))
    extra = {"ignore_eos": True}
    async with openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0
    ) as client:
        reply = await client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=12, extra_body=extra
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 12
        assert reply.choices[0].message.content

        stream = await client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 12

        completion = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10, extra_body=extra
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 10
        assert completion.choices[0].text

        pieces = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10, stream=True, extra_body=extra
        )
        texts = [c.choices[0].text async for c in pieces if c.choices]
        assert "".join(texts)
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0)
    proxy.assert_idle()


# -- seats and queues ----------------------------------------------------------------------


async def test_the_proxy_queues_so_the_engine_never_does(
    start_proxy: Start, llama_pair: list[LlamaServer]
) -> None:
    """Seats equal to the slots: the engines' own queue stays empty while the proxy
    queues tenant a's excess, refuses what does not fit its queue, and refuses
    tenant b's request whose queue budget is too short for the wait.

    Tenant a's budgets outlast three rounds of 600 tokens on any machine, so
    which of its requests are served depends on its queue's capacity only (with
    the default 2 s ``queue_ms`` a slow machine timed two of them out)."""
    tenants = {
        "a": {
            "api_keys": [KEY_A],
            "queue_capacity": 6,
            "budgets": {"queue_ms": 150_000, "total_ms": 170_000},
        },
        "b": {"api_keys": [KEY_B], "budgets": {"queue_ms": 30}},
    }
    proxy = await start_proxy(engine_config(llama_pair, tenants=tenants))
    await engines_idle(llama_pair)
    client = proxy.client
    with Sampler(llama_pair, proxy) as sampler:
        burst = [
            asyncio.create_task(client.post(CHAT, json=chat(600), headers=auth()))
            for _ in range(14)
        ]
        await wait_for(lambda: proxy.runtime.dispatcher.queued() == 6, timeout_s=10)
        late = await client.post(CHAT, json=chat(8), headers=auth(KEY_B))
        responses = await asyncio.gather(*burst)
        seen = sampler.samples
        await wait_for(lambda: sampler.samples >= seen + 2)  # a full round after the last
    statuses = Counter(r.status for r in responses)
    reasons = Counter(r.headers.get("X-Admission-Reason") for r in responses if r.status != 200)
    assert statuses == {200: 10, 429: 4}, statuses
    assert reasons == {"tenant_queue_full": 4}
    for response in responses:
        if response.status == 200:
            assert (await response.json())["usage"]["completion_tokens"] == 600
    assert late.status == 503
    assert late.headers["X-Admission-Reason"] in {"queue_timeout", "predicted_wait_exceeds_budget"}
    assert float(late.headers["Retry-After"]) > 0
    assert sampler.samples > 5
    assert sampler.max_queued >= 6, "the excess waited in the proxy"
    assert sampler.max_deferred == 0, "the engine never had to queue"
    assert sampler.max_processing <= 2
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0)
    proxy.assert_idle()


async def test_the_engine_alone_queues_without_limit(llama_pair: list[LlamaServer]) -> None:
    """The contrast: eight requests straight at a 2-slot engine are all accepted;
    six wait with no answer and no bound, some in the engine's queue
    (``requests_deferred``), the rest unread in its HTTP threads' backlog (on two
    cores llama-server handles about five connections at once)."""
    server = llama_pair[0]
    await engines_idle(llama_pair)
    async with aiohttp.ClientSession() as session:
        with Sampler([server]) as sampler:
            results = await asyncio.gather(
                *(session.post(server.url + CHAT, json=chat(1500)) for _ in range(8))
            )
        assert [r.status for r in results] == [200] * 8
    assert sampler.max_deferred >= 1


# -- fairness ------------------------------------------------------------------------------


async def closed_loop(
    post: Callable[[str], Awaitable[int]], workers: dict[str, int], total: int
) -> Counter[str]:
    """Workers per tenant, each sending one request after another, until ``total`` are served."""
    served: Counter[str] = Counter()
    done = asyncio.Event()

    async def worker(tenant: str) -> None:
        while not done.is_set():
            status = await post(tenant)
            if status == 200 and not done.is_set():
                served[tenant] += 1
                if sum(served.values()) >= total:
                    done.set()
            elif status != 200:
                await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(worker(t)) for t, n in workers.items() for _ in range(n)]
    try:
        async with asyncio.timeout(90):
            await done.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return served


async def test_equal_tenants_share_the_real_engine_equally(
    start_proxy: Start, llama_pair: list[LlamaServer]
) -> None:
    """Tenant a runs 12 clients, b runs 4, both more than their 2 of 4 seats: through
    the proxy each gets about half; straight at the engines a gets about 3/4."""
    keys = {"a": KEY_A, "b": KEY_B}
    proxy = await start_proxy(engine_config(llama_pair, tenants=EQUAL_TENANTS))
    await engines_idle(llama_pair)

    async def via_proxy(tenant: str) -> int:
        async with proxy.client.post(CHAT, json=chat(300), headers=auth(keys[tenant])) as r:
            await r.read()
            return r.status

    shares = await closed_loop(via_proxy, {"a": 12, "b": 4}, total=60)
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0, timeout_s=10)
    proxy.assert_idle()

    turn = iter(range(10**6))
    async with aiohttp.ClientSession() as session:

        async def direct(tenant: str) -> int:
            server = llama_pair[next(turn) % 2]
            async with session.post(server.url + CHAT, json=chat(300)) as r:
                await r.read()
                return r.status

        direct_shares = await closed_loop(direct, {"a": 12, "b": 4}, total=60)
    proxied_b = shares["b"] / sum(shares.values())
    direct_b = direct_shares["b"] / sum(direct_shares.values())
    assert 0.38 <= proxied_b <= 0.62, shares
    assert direct_b < 0.38, direct_shares


# -- cancellation --------------------------------------------------------------------------


async def test_client_leaving_a_stream_cancels_the_engine_request(
    start_proxy: Start, llama_pair: list[LlamaServer]
) -> None:
    """A client that closes a 3,000-token stream after its first token: the engine
    stops generating (its slot frees, far fewer tokens than asked), and the proxy's
    seat comes back after the cancel grace."""
    config = engine_config(llama_pair, timeouts={"cancel_grace_ms": 200})
    proxy = await start_proxy(config)
    await engines_idle(llama_pair)
    async with aiohttp.ClientSession() as session:
        before = {s.name: (await engine_gauges(session, s))["llamacpp:tokens_predicted_total"]
                  for s in llama_pair}  # fmt: skip
        response = await session.post(
            proxy.url + CHAT, json=chat(3000, stream=True), headers=auth()
        )
        assert response.status == 200
        async for raw in response.content:
            if b'"content"' in raw:
                break
        response.close()

        async def busy_slots() -> int:
            busy = 0
            for server in llama_pair:
                busy += int((await engine_gauges(session, server))["llamacpp:requests_processing"])
            return busy

        # The slot frees well before the 3,000 tokens could have run (the token count
        # below is the proof that generation stopped; this wait only bounds the test).
        async with asyncio.timeout(5):
            while await busy_slots():
                await asyncio.sleep(0.01)
        after = {s.name: (await engine_gauges(session, s))["llamacpp:tokens_predicted_total"]
                 for s in llama_pair}  # fmt: skip
    generated = sum(after.values()) - sum(before.values())
    # Alone it would run 3,000 tokens (about a second); cancelled, a handful.
    assert generated < 500, f"the engine kept generating ({generated} tokens)"
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0, timeout_s=5)
    proxy.assert_idle()


# -- a crash and a restart -----------------------------------------------------------------


@pytest.fixture
def crash_pair(real_engine: Engine, tmp_path: Any) -> Iterator[list[LlamaServer]]:
    """Its own two replicas: this test kills one."""
    with llama_servers(real_engine, tmp_path, 2, parallel=2) as servers:
        yield servers


async def test_replica_killed_mid_stream_is_ejected_by_its_broken_streams_and_returns(
    start_proxy: Start, crash_pair: list[LlamaServer]
) -> None:
    config = engine_config(
        crash_pair,
        # Probes a second apart: the broken streams, not a probe, eject r1.
        health={"interval_ms": 1000, "eject_after_failures": 1, "eject_ms": 300},
        retry={"max_attempts": 3, "base_backoff_ms": 20, "retry_on": ["connect_error"]},
        warmup={"requests": 1},
    )
    proxy = await start_proxy(config)
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas), timeout_s=10)
    victim, survivor = crash_pair[1], crash_pair[0]
    r1 = proxy.runtime.pool.get("r1")
    assert r1 is not None
    async with aiohttp.ClientSession() as session:
        # Four long streams: two on each replica (least loaded first).
        streams = [
            await session.post(proxy.url + CHAT, json=chat(3500, stream=True), headers=auth())
            for _ in range(4)
        ]
        assert [s.status for s in streams] == [200] * 4
        assert r1.inflight == 2
        victim.kill()
        await wait_for(lambda: r1.inflight == 0, timeout_s=5)
        # Its streams broke mid-answer: each counts toward ejection like a reset before
        # the first byte, so r1 is out before any new request could be sent to it.
        assert r1.ejected
        outcomes = await asyncio.gather(*(read_sse(s) for s in streams), return_exceptions=True)
        finished = [o for o in outcomes if isinstance(o, tuple) and o[1]]
        broken = [o for o in outcomes if not (isinstance(o, tuple) and o[1])]
        assert len(finished) == 2 and len(broken) == 2, "only the killed replica's streams break"
        metrics = await (await proxy.client.get("/metrics")).text()
        assert 'admission_retries_total{reason="connect_error"}' not in metrics, "none sent to r1"

        # While r1 is out, everything goes to the survivor: none fails.
        replies = await asyncio.gather(
            *(session.post(proxy.url + CHAT, json=chat(16), headers=auth()) for _ in range(6))
        )
        assert [r.status for r in replies] == [200] * 6

        # Back on the same port: probed, warmed, then serving again.
        victim.start()
        await wait_for(lambda: r1.serving and not r1.warming, timeout_s=20)
        warmed = (await engine_gauges(session, victim))["llamacpp:prompt_tokens_total"]
        assert warmed > 0, "the warm-up request reached the restarted engine first"
        more = await asyncio.gather(
            *(session.post(proxy.url + CHAT, json=chat(200), headers=auth()) for _ in range(8))
        )
        assert [r.status for r in more] == [200] * 8
        served_after = (await engine_gauges(session, victim))["llamacpp:tokens_predicted_total"]
        assert served_after > 200, "the returned replica takes traffic again"
    _ = survivor
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0, timeout_s=5)
    proxy.assert_idle()


# -- timing agrees with the engine ---------------------------------------------------------


async def test_proxy_timing_and_tokens_agree_with_the_engine(
    start_proxy: Start, llama_pair: list[LlamaServer]
) -> None:
    """llama.cpp reports no timing headers, so ``proxy.batch`` and ``proxy.gpu`` are
    the proxy's own (``timing_source=proxy``); they must bracket what the engine
    says it spent, and the token counts must be the engine's."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    proxy = await start_proxy(engine_config(llama_pair), tracer_provider=provider)
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas), timeout_s=10)
    await engines_idle(llama_pair)
    exporter.clear()  # warm-up spans, if any
    async with proxy.client.post(CHAT, json=chat(800, stream=True), headers=auth()) as response:
        assert response.status == 200
        events, done = await read_sse(response)
    assert done
    final = events[-1]
    usage, timings = final["usage"], final["timings"]
    assert usage["completion_tokens"] == timings["predicted_n"] == 800
    await wait_for(lambda: any(s.name == "proxy.request" for s in exporter.get_finished_spans()))
    spans = {s.name: s for s in exporter.get_finished_spans()}

    def ms(span: ReadableSpan) -> float:
        assert span.start_time is not None and span.end_time is not None
        return (span.end_time - span.start_time) / 1e6

    batch, gpu, request = spans["proxy.batch"], spans["proxy.gpu"], spans["proxy.request"]
    assert batch.attributes is not None and gpu.attributes is not None
    assert batch.attributes["admission.timing_source"] == "proxy"
    assert gpu.attributes["admission.timing_source"] == "proxy"
    assert gpu.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert gpu.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    # The engine's prompt time falls inside the proxy's time to first token...
    assert ms(batch) >= timings["prompt_ms"] * 0.9
    # ...and its generation time matches first token to last chunk: all but the
    # first of 800 tokens, plus transport; generous bounds for a noisy machine.
    assert timings["predicted_ms"] * 0.8 <= ms(gpu) <= timings["predicted_ms"] + 1000
    assert ms(batch) + ms(gpu) <= ms(request)
