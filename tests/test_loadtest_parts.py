"""The load test's parts on their own: goodput rule, drain time, metrics parsing,
SSE reading, and the bounds of the closed and open loops."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.loadtest.client import build_spec, make_session, queue_wait, send_one
from proxy.loadtest.generator import run_closed_loop, run_open_loop
from proxy.loadtest.results import RequestResult, RequestSpec, percentile
from proxy.loadtest.schedule import PhaseWindow, build_arrivals, phase_windows
from proxy.loadtest.scrape import MetricsSample, parse_metrics
from proxy.loadtest.timeline import (
    GOOD,
    SLO_MISSED,
    classify,
    drain_after,
    is_good,
    summarise_phases,
)
from proxy.loadtest.workload import Phase, Slo, parse_workload
from tests.upstreams import UPSTREAM, build_upstream

ServerFactory = Callable[..., Awaitable[TestServer]]


def result(
    *,
    latency_s: float = 1.0,
    ttft_s: float | None = 0.1,
    tokens: int = 10,
    error: str | None = None,
    reason: str | None = None,
    tenant: str = "a",
    phase: str = "p",
    started_at: float = 0.0,
) -> RequestResult:
    return RequestResult(
        index=0,
        started_at=started_at,
        ended_at=started_at + latency_s,
        status=200 if error is None else 503,
        error=error,
        reason=reason,
        ttft_s=ttft_s,
        output_tokens=tokens,
        tenant=tenant,
        phase=phase,
        due_at=started_at,
    )


# --- goodput -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_result", "slo", "good"),
    [
        pytest.param(result(), Slo(), True, id="no-slo"),
        pytest.param(result(ttft_s=0.3), Slo(ttft_ms=200), False, id="ttft-missed"),
        pytest.param(result(ttft_s=0.2), Slo(ttft_ms=200), True, id="ttft-at-limit"),
        pytest.param(result(ttft_s=None), Slo(ttft_ms=200), False, id="ttft-unknown"),
        pytest.param(result(latency_s=2.5), Slo(total_ms=2000), False, id="total-missed"),
        # (1.0 - 0.1) / 9 tokens after the first = 100 ms per token
        pytest.param(result(), Slo(tpot_ms=99), False, id="tpot-missed"),
        pytest.param(result(), Slo(tpot_ms=101), True, id="tpot-met"),
        pytest.param(result(error="http_503"), Slo(), False, id="failed"),
    ],
)
def test_goodput_rule(request_result: RequestResult, slo: Slo, good: bool) -> None:
    """Good means succeeded and met every SLO that is set (vLLM's definition)."""
    assert is_good(request_result, slo) is good


def test_classify_names_the_proxy_reason_first() -> None:
    slo = Slo(total_ms=500)
    assert classify(result(latency_s=0.1), slo) == GOOD
    assert classify(result(latency_s=1.0), slo) == SLO_MISSED
    assert classify(result(error="http_503", reason="queue_timeout"), slo) == "queue_timeout"
    assert classify(result(error="http_503", reason="upstream_status"), slo) == "http_503"
    assert classify(result(error="connect_error"), slo) == "connect_error"


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


# --- drain time and summaries ------------------------------------------------

WINDOW = PhaseWindow(Phase(name="burst", duration_s=2.0, rate_per_s=10), 1.0, 3.0)


def depth_samples(*points: tuple[float, float]) -> list[MetricsSample]:
    return [MetricsSample(t=t, queue_depth={"a/standard": d}) for t, d in points]


@pytest.mark.parametrize(
    ("points", "depth_at_end", "drain_s"),
    [
        pytest.param([(2.9, 7), (3.2, 4), (3.8, 0), (4.0, 0)], 7, pytest.approx(0.8), id="drains"),
        pytest.param([(2.9, 0), (3.2, 0)], 0, 0.0, id="empty-at-end"),
        pytest.param([(2.9, 5), (3.5, 2)], 5, None, id="never"),
    ],
)
def test_drain_after(
    points: list[tuple[float, float]], depth_at_end: float, drain_s: object
) -> None:
    """Drain time: from the phase's end to the first scrape that saw every queue empty."""
    drain = drain_after(WINDOW, depth_samples(*points), 0.1)
    assert drain.depth_at_end == depth_at_end
    assert drain.drain_s == drain_s


def test_drain_without_queue_metrics_is_unknown() -> None:
    drain = drain_after(WINDOW, [MetricsSample(t=3.5)], 0.1)
    assert drain.depth_at_end is None and drain.drain_s is None


def test_summary_counts_every_request_once() -> None:
    """good + SLO missed + failures by reason add up to sent; unsent arrivals stay apart."""
    workload = parse_workload(
        """
slo: {total_ms: 500}
request_classes: {s: {input_tokens: [1, 2], max_tokens: 2}}
tenants:
  a: {api_key: k, mix: {s: 1}}
  b: {api_key: k2, mix: {s: 1}, slo: {total_ms: 5000}}
phases:
  - {name: one, duration_s: 1, rate_per_s: 4}
  - {name: two, duration_s: 1, rate_per_s: 4}
"""
    )
    results = [
        result(latency_s=0.1, phase="one"),
        result(latency_s=1.0, phase="one"),  # a: over 500 ms
        result(latency_s=1.0, phase="one", tenant="b"),  # b: within 5 s
        result(error="http_429", reason="tenant_queue_full", phase="two", started_at=1.2),
        result(error="generator_overloaded", phase="two", started_at=1.5),
    ]
    summary = summarise_phases(
        results,
        build_arrivals(workload),
        phase_windows(workload),
        [],
        workload,
        end_s=2.5,
    )
    total = summary.total
    assert (total.sent, total.ok, total.good, total.not_sent) == (4, 3, 2, 1)
    assert total.outcomes == {GOOD: 2, SLO_MISSED: 1, "tenant_queue_full": 1}
    assert total.rejections == {"tenant_queue_full": 1}
    assert [p.good for p in summary.phases] == [2, 0]
    assert {t.name: t.good for t in summary.tenants} == {"a": 1, "b": 1}
    assert total.goodput_per_s == pytest.approx(1.0)  # 2 good over 2 s of phases
    assert summary.drain.drain_s is None  # no metrics scraped


# --- metrics ----------------------------------------------------------------

PROXY_METRICS = """\
# TYPE admission_queue_depth gauge
admission_queue_depth{priority="standard",tenant="a"} 3.0
admission_queue_depth{priority="batch",tenant="b"} 2.0
# TYPE admission_retries_total counter
admission_retries_total{reason="http_503"} 4.0
admission_retries_total{reason="connect_error"} 1.0
# TYPE admission_retry_budget_exhausted_total counter
admission_retry_budget_exhausted_total 2.0
# TYPE admission_replica_inflight gauge
admission_replica_inflight{replica="r0"} 4.0
admission_replica_inflight{replica="r1"} 3.0
# TYPE admission_gpu_memory_used_ratio gauge
admission_gpu_memory_used_ratio{gpu="0"} 0.5
admission_gpu_memory_used_ratio{gpu="1"} 0.75
"""

VLLM_METRICS = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 6.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.42
"""


def test_parse_proxy_metrics() -> None:
    sample = parse_metrics(PROXY_METRICS, 1.5)
    assert sample.total_depth == 5.0
    assert dict(sample.retries) == {"http_503": 4.0, "connect_error": 1.0}
    assert sample.retry_budget_exhausted == 2.0
    assert sample.replica_inflight == 7.0
    assert (sample.memory_ratio, sample.memory_source) == (0.75, "gpu_memory")


def test_engine_kv_cache_wins_over_gpu_memory() -> None:
    """KV-cache usage says more than NVML memory (vLLM preallocates 90% of the GPU)."""
    sample = parse_metrics(VLLM_METRICS + PROXY_METRICS.split("# TYPE admission_gpu")[0], 0.0)
    assert (sample.memory_ratio, sample.memory_source) == (0.42, "kv_cache")
    alone = parse_metrics(VLLM_METRICS, 0.0)
    assert alone.total_depth == 6.0  # a bare engine: its waiting queue


# --- the client ---------------------------------------------------------------


def sse_upstream() -> web.Application:
    """Streams with a keep-alive comment, a role-only delta, then tokens; or fails."""

    async def chat(request: web.Request) -> web.StreamResponse:
        mode = request.headers.get("X-Mode", "ok")
        if mode == "reject":
            return web.json_response(
                {"error": {"code": "queue_timeout"}},
                status=503,
                headers={"X-Admission-Reason": "queue_timeout"},
            )
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Server-Timing": "entrance;dur=0.2, queue;dur=12.5, upstream;dur=3.0",
            }
        )
        await response.prepare(request)
        await response.write(b": keep-alive\n\n")
        await response.write(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n')
        await asyncio.sleep(0.05)  # the role-only delta must not start the TTFT clock
        for word in ("a", "b", "c"):
            await response.write(
                b'data: {"choices":[{"delta":{"content":"' + word.encode() + b'"}}]}\n\n'
            )
        if mode == "error":
            await response.write(b'data: {"error": {"code": "idle_timeout"}}\n\n')
            return response
        await response.write(b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def spec(mode: str = "ok") -> RequestSpec:
    return build_spec(
        endpoint="chat",
        model="m",
        input_tokens=8,
        max_tokens=3,
        rng=random.Random(0),
        headers={"X-Mode": mode},
    )


async def test_send_one_reads_ttft_tokens_and_queue_wait(aiohttp_server: ServerFactory) -> None:
    """TTFT counts from the first content delta, not the comment or the role-only delta."""
    server = await aiohttp_server(sse_upstream())
    url = str(server.make_url("")).rstrip("/")
    async with make_session(4, 5.0) as session:
        zero = time.perf_counter()
        ok = await send_one(session, url, spec(), index=0, zero=zero)
        failed = await send_one(session, url, spec("error"), index=1, zero=zero)
        rejected = await send_one(session, url, spec("reject"), index=2, zero=zero)
    assert ok.ok and ok.output_tokens == 3
    assert ok.ttft_s is not None and ok.ttft_s >= 0.05
    assert (ok.queue_ms, ok.queue_source) == (12.5, "proxy")
    assert failed.error == "stream_error:idle_timeout"
    assert (rejected.error, rejected.reason, rejected.status) == ("http_503", "queue_timeout", 503)


async def test_send_one_names_a_refused_connection() -> None:
    async with make_session(1, 2.0) as session:
        outcome = await send_one(
            session,
            "http://127.0.0.1:9",
            spec(),
            index=0,
            zero=time.perf_counter(),
        )
    assert outcome.error == "connect_error" and not math.isnan(outcome.ended_at)


async def test_send_one_resends_on_a_connection_the_replica_dropped(
    aiohttp_server: ServerFactory,
) -> None:
    """llama-server closes the connection after a stream; the next request is sent
    again on a new connection instead of counting as an error."""
    upstream = build_upstream()
    server = await aiohttp_server(upstream)
    url = str(server.make_url("")).rstrip("/")
    headers = {"Content-Type": "application/json"}
    doomed = RequestSpec(
        "/v1/chat/completions",
        json.dumps({"max_tokens": 2, "stream": True, "stale_after": True}).encode(),
        headers, input_tokens=1, max_tokens=2,
    )  # fmt: skip
    plain = RequestSpec(
        "/v1/chat/completions", b'{"max_tokens": 2}', headers, input_tokens=1, max_tokens=2,
        stream=False,
    )  # fmt: skip
    async with make_session(1, 2.0) as session:
        zero = time.perf_counter()
        outcomes = []
        for i in range(3):
            outcomes.append(await send_one(session, url, doomed, index=2 * i, zero=zero))
            outcomes.append(await send_one(session, url, plain, index=2 * i + 1, zero=zero))
    assert upstream[UPSTREAM].stale_hits == 1, "one dropped connection, then Connection: close"
    assert [o.error for o in outcomes] == [None] * 6


def test_queue_wait_sources() -> None:
    assert queue_wait({"x-queue-time": "7"}) == (7.0, "engine")
    assert queue_wait({}) == (None, None)


# --- loop bounds --------------------------------------------------------------


def quick_upstream(delay_s: float) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        await asyncio.sleep(delay_s)
        return web.json_response({"usage": {"completion_tokens": 1}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_closed_loop_is_bounded_and_keeps_its_concurrency(
    aiohttp_server: ServerFactory,
) -> None:
    """Counted level: at most warmup + requests + concurrency sent, exactly `requests` measured."""
    server = await aiohttp_server(quick_upstream(0.02))
    url = str(server.make_url("")).rstrip("/")

    def make(index: int) -> RequestSpec:
        return build_spec(
            endpoint="chat", model="m", input_tokens=4, max_tokens=1, rng=random.Random(index),
            stream=False,
        )  # fmt: skip

    async with make_session(8, 5.0) as session:
        run = await run_closed_loop(
            session,
            url,
            make,
            concurrency=4,
            warmup=4,
            requests=20,
            max_duration_s=10.0,
            zero=time.perf_counter(),
        )
        timed = await run_closed_loop(
            session,
            url,
            make,
            concurrency=2,
            warmup=0,
            seconds=0.3,
            max_duration_s=10.0,
            zero=time.perf_counter(),
        )
    assert len(run.measured) == 20
    assert 24 <= len(run.results) <= 28
    assert not run.truncated
    start, end = timed.window
    assert end - start == pytest.approx(0.3, abs=0.1)
    assert all(start < r.ended_at <= end for r in timed.measured)
    assert len(timed.results) < 100


async def test_closed_loop_gives_up_after_its_time_cap(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(quick_upstream(5.0))
    url = str(server.make_url("")).rstrip("/")
    async with make_session(2, 30.0) as session:
        began = time.perf_counter()
        run = await run_closed_loop(
            session,
            url,
            lambda i: build_spec(
                endpoint="chat", model="m", input_tokens=1, max_tokens=1, rng=random.Random(i)
            ),
            concurrency=2,
            warmup=0,
            requests=10,
            max_duration_s=0.3,
            zero=began,
        )
    assert run.truncated
    assert time.perf_counter() - began < 2.0


async def test_open_loop_sends_on_time_and_caps_what_is_unanswered(
    aiohttp_server: ServerFactory,
) -> None:
    """Arrivals go out when due, whatever is pending; past the cap they are counted, not sent."""
    server = await aiohttp_server(quick_upstream(0.5))
    url = str(server.make_url("")).rstrip("/")
    due = [0.01 * i for i in range(10)]
    async with make_session(16, 5.0) as session:
        run = await run_open_loop(
            session,
            url,
            due,
            lambda i: build_spec(
                endpoint="chat",
                model="m",
                input_tokens=1,
                max_tokens=1,
                rng=random.Random(i),
                stream=False,
            ),
            zero=time.perf_counter(),
            max_in_flight=6,
            drain_timeout_s=5.0,
        )
    assert run.overloaded == 4
    sent = [r for r in run.results if r.error != "generator_overloaded"]
    assert len(sent) == 6 and all(r.ok for r in sent)
    assert max(r.started_at - (r.due_at or 0.0) for r in sent) < 0.1
