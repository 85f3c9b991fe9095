"""Engine metrics with several series per name: ratios take the max, counts the sum.

Pages are written the way the engines print them (HELP/TYPE lines, labels per
data-parallel rank or model, histograms and counters around the gauges read).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.health import parse_engine_metrics
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
ServerFactory = Callable[..., Awaitable[TestServer]]

MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'

#: vLLM V1 with --data-parallel-size 2: every gauge once per engine core.
VLLM_DP2 = f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 12.0
vllm:num_requests_running{{engine="1",{MODEL}}} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{MODEL}}} 3.0
vllm:num_requests_waiting{{engine="1",{MODEL}}} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.62
vllm:kv_cache_usage_perc{{engine="1",{MODEL}}} 0.71
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",{MODEL}}} 81234.0
vllm:prompt_tokens_total{{engine="1",{MODEL}}} 79012.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",{MODEL}}} 310.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{MODEL}}} 400.0
vllm:time_to_first_token_seconds_count{{engine="0",{MODEL}}} 400.0
vllm:time_to_first_token_seconds_sum{{engine="0",{MODEL}}} 21.5
"""

#: SGLang with data-parallel attention: one series per DP rank.
SGLANG_DP2 = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0"} 20.0
sglang:num_running_reqs{dp_rank="1",model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0"} 18.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0"} 2.0
sglang:num_queue_reqs{dp_rank="1",model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0"} 5.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0"} 0.4
sglang:token_usage{dp_rank="1",model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0"} 0.55
"""

#: llama.cpp (an older build, which still exported its KV-cache ratio): no labels.
LLAMACPP = """\
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.3
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 5120
"""

#: One rank's gauge not yet set (NaN): the other rank's value is the reading.
VLLM_NAN_RANK = f"""\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} NaN
vllm:kv_cache_usage_perc{{engine="1",{MODEL}}} 0.2
"""


@pytest.mark.parametrize(
    ("text", "waiting", "running", "kv"),
    [
        (VLLM_DP2, 4.0, 21.0, 0.71),
        (SGLANG_DP2, 7.0, 38.0, 0.55),
        (LLAMACPP, 1.0, 4.0, 0.3),
        (VLLM_NAN_RANK, None, None, 0.2),
    ],
    ids=["vllm-dp2", "sglang-dp2", "llamacpp", "vllm-nan-rank"],
)
def test_counts_sum_and_ratios_take_the_fullest_series(
    text: str, waiting: float | None, running: float | None, kv: float
) -> None:
    """Per-rank series: waiting and running add up across ranks; KV-cache usage is
    the fullest rank's, never a sum above 1."""
    reading = parse_engine_metrics(text, at=1.0)
    assert (reading.waiting, reading.running) == (waiting, running)
    assert reading.kv_cache == pytest.approx(kv)


async def test_two_ranks_at_60_percent_do_not_hold_the_replica_off(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """A replica whose two DP ranks each use 60% of their KV cache, with
    max_kv_cache 0.9: it reads 0.6, is not saturated, and serves (a sum, 1.2,
    would hold it off forever)."""
    page = VLLM_DP2.replace("0.62", "0.6").replace("0.71", "0.6")
    scrapes = []

    async def metrics(request: web.Request) -> web.Response:
        scrapes.append(request.path)
        return web.Response(text=page)

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", answer)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    config = make_config(
        [], replicas=[{"name": "r0", "url": url, "max_concurrency": 2,
                       "metrics_url": url + "/metrics"}],
        saturation={"max_kv_cache": 0.9, "stale_ms": 60_000}, health={"interval_ms": 50},
    )  # fmt: skip
    proxy = await start_proxy(config)
    await wait_for(lambda: len(scrapes) >= 2)
    reading = proxy.runtime.health.engine_reading("r0")
    assert reading is not None and reading.kv_cache == pytest.approx(0.6)
    r0 = proxy.runtime.pool.replicas[0]
    assert not r0.saturated
    headers = {"Authorization": f"Bearer {KEY_A}"}
    resp = await proxy.client.post("/v1/chat/completions", json={}, headers=headers)
    assert resp.status == 200
    proxy.assert_idle()
