"""Token quotas against a real ``llama-server``, driven by the official OpenAI client.

The quota counts what llama-server reports (``usage``), the headers count
down by exactly that, a stream whose client did not ask for usage is charged
the usage the proxy asked for on its behalf (and the client sees no usage
chunk), and the first request whose estimate no longer fits is refused with
429 ``token_quota_exceeded``, which the client surfaces as ``RateLimitError``.
The quotas' clock is a fake one (the UTC day cannot change mid-test).
"""

from __future__ import annotations

import io
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from bench.real_engine import Engine
from proxy.clock import FakeClock
from tests.conftest import ProxyUnderTest
from tests.engine import MODEL, LlamaServer, llama_servers
from tests.helpers import KEY_A, make_config, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.timeout(180)]

Start = Callable[..., Awaitable[ProxyUnderTest]]
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count the waves."}]
QUOTA = 200
MAX_TOKENS = 16
#: Requests are bounded: the quota runs out within a handful.
MAX_REQUESTS = 20


@pytest.fixture(scope="module")
def llama_one(
    real_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LlamaServer]]:
    """One replica with ``--parallel 2`` and one thread."""
    with llama_servers(real_engine, tmp_path_factory.mktemp("llama"), 1, parallel=2) as servers:
        yield servers


def _config(servers: list[LlamaServer], quota: int = QUOTA) -> Any:
    replicas = [{"name": "r0", "url": servers[0].url, "max_concurrency": 2}]
    tenants = {"a": {"api_keys": [KEY_A], "token_quota": {"per_day": quota}}}
    return make_config([], replicas=replicas, tenants=tenants, health={"interval_ms": 100})


async def test_quota_counts_llama_server_usage_and_refuses_when_spent(
    start_proxy: Start, llama_one: list[LlamaServer]
) -> None:
    """per_day 200: a stream (usage asked for by the proxy) then plain requests until the
    quota is spent; the headers count down by llama-server's usage, then 429."""
    log = io.StringIO()
    clock = FakeClock(start=1_796_140_800.0)  # 2026-12-01 16:00 UTC
    proxy = await start_proxy(_config(llama_one), quota_clock=clock, access_log=log)
    extra = {"ignore_eos": True}
    left = QUOTA
    async with openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0
    ) as client:
        # A stream that did not ask for usage: the client gets none, the quota counts it.
        stream = await client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=MAX_TOKENS, stream=True, extra_body=extra
        )
        chunks = [chunk async for chunk in stream]
        assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
        await wait_for(lambda: not proxy.runtime.active, timeout_s=10)
        streamed = json.loads(log.getvalue().splitlines()[-1])["quota_actual_tokens"]
        left -= streamed

        actuals: list[int] = []
        refused: openai.RateLimitError | None = None
        for _ in range(MAX_REQUESTS):
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=MSG, max_tokens=MAX_TOKENS, extra_body=extra
                )
            except openai.RateLimitError as exc:
                refused = exc
                break
            reply = raw.parse()
            assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS
            used = reply.usage.prompt_tokens + reply.usage.completion_tokens
            actuals.append(used)
            left -= used
            # Counted down by exactly what llama-server reported.
            assert raw.headers["x-ratelimit-limit-tokens"] == str(QUOTA)
            assert raw.headers["x-ratelimit-remaining-tokens"] == str(left)
    assert refused is not None, "the quota never ran out"
    assert actuals and streamed == actuals[0]  # the stream's usage, as the engine counted it
    assert refused.response.headers["X-Admission-Reason"] == "token_quota_exceeded"
    assert refused.response.headers["x-ratelimit-remaining-tokens"] == str(left)
    assert int(refused.response.headers["Retry-After"]) == 8 * 3600  # to 00:00 UTC
    # Refused exactly when the next estimate no longer fits what is left.
    await wait_for(lambda: not proxy.runtime.active, timeout_s=10)
    estimate = json.loads(log.getvalue().splitlines()[-2])["quota_charged_tokens"]
    assert left < estimate <= left + actuals[-1]
    proxy.assert_idle()


async def test_llama_cpp_native_completion_is_charged_what_llama_server_counts(
    start_proxy: Start, llama_one: list[LlamaServer]
) -> None:
    """llama.cpp's own ``/completion``, streamed and not: charged its ``n_predict`` at
    admission and corrected to llama-server's own counts (``tokens_evaluated`` +
    ``tokens_predicted``); a stream gets its time to first token. Before, this route
    took a seat but was never charged, so a quota could be stepped around with it."""
    log = io.StringIO()
    clock = FakeClock(start=1_796_140_800.0)
    proxy = await start_proxy(_config(llama_one), quota_clock=clock, access_log=log)
    auth = {"Authorization": f"Bearer {KEY_A}"}
    left = QUOTA
    for stream in (True, False):
        body = {"prompt": "Count the waves.", "n_predict": 6, "ignore_eos": True, "stream": stream}
        async with proxy.client.post("/completion", json=body, headers=auth) as response:
            assert response.status == 200
            raw = await response.read()
            remaining = response.headers["x-ratelimit-remaining-tokens"]
        await wait_for(lambda: not proxy.runtime.active, timeout_s=10)
        line = json.loads(log.getvalue().splitlines()[-1])
        if stream:
            last = json.loads(raw.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
            assert line["ttft_ms"] is not None and line["ttft_ms"] > 0
        else:
            last = json.loads(raw)
            # The whole answer was there at once: its headers count its real usage.
            assert int(remaining) == left - last["tokens_evaluated"] - last["tokens_predicted"]
        assert last["tokens_predicted"] == 6
        assert line["quota_charged_tokens"] == len(json.dumps(body)) // 4 + 6
        assert (line["input_tokens"], line["output_tokens"]) == (last["tokens_evaluated"], 6)
        assert line["quota_actual_tokens"] == last["tokens_evaluated"] + 6
        left -= line["quota_actual_tokens"]
    proxy.assert_idle()


@pytest.mark.parametrize(
    ("prompts", "stream"),
    [(3, False), (3, True), (200, False)],  # 200 answers: far past what a body's head keeps
)
async def test_llama_cpp_batch_completion_is_charged_every_answer(
    start_proxy: Start, llama_one: list[LlamaServer], prompts: int, stream: bool
) -> None:
    """llama.cpp's ``/completion`` with a list of prompts answers each one (a JSON array,
    or one stream interleaving them by ``index``): charged ``n_predict`` per prompt at
    admission and settled to the sum of every answer's counts. It used to be charged
    one prompt's output and settled to the first answer's counts alone."""
    log = io.StringIO()
    clock = FakeClock(start=1_796_140_800.0)
    proxy = await start_proxy(_config(llama_one, 100_000), quota_clock=clock, access_log=log)
    body = {"prompt": [f"wave {i}" for i in range(prompts)], "n_predict": 3, "ignore_eos": True,
            "stream": stream}  # fmt: skip
    auth = {"Authorization": f"Bearer {KEY_A}"}
    async with proxy.client.post("/completion", json=body, headers=auth) as response:
        assert response.status == 200
        raw = await response.read()
    await wait_for(lambda: not proxy.runtime.active, timeout_s=30)
    if stream:
        events = [json.loads(e.removeprefix(b"data: ")) for e in raw.strip().split(b"\n\n")]
        answers = [e for e in events if isinstance(e, dict) and e.get("stop")]
    else:
        answers = json.loads(raw)
    assert len(answers) == prompts
    evaluated = sum(answer["tokens_evaluated"] for answer in answers)
    assert sum(answer["tokens_predicted"] for answer in answers) == 3 * prompts
    line = json.loads(log.getvalue().splitlines()[-1])
    assert line["quota_charged_tokens"] == len(json.dumps(body)) // 4 + 3 * prompts
    assert (line["input_tokens"], line["output_tokens"]) == (evaluated, 3 * prompts)
    assert line["quota_actual_tokens"] == evaluated + 3 * prompts
    proxy.assert_idle()
