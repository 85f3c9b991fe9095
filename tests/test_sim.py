"""Tests of the simulated GPU replica (`proxy.sim`).

Scheduling is tested on the engine alone with a stepped fake GPU (no sockets,
no wall clock); the HTTP contract, faults and disconnects against real sims on
ports the OS picks. Waits are bounded polling loops, never timing assertions
beyond exact lower bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pytest_aiohttp import AiohttpClient

from proxy.sim import Faults, FaultsError, SimConfig, SimEngine, SimServer, build_sim_app, start_sim
from proxy.sim.cli import add_sim_arguments, config_from_args
from proxy.sim.engine import EngineFull, PromptTooLong
from proxy.sim.faults import FaultDice, update_faults
from proxy.sim.protocol import estimate_tokens
from proxy.sim.sequence import VOCABULARY, Sequence, SequenceAborted, SequenceState

FAST = SimConfig(decode_base_ms=1.0, decode_per_seq_ms=0.1, prefill_ms_per_token=0.0)
"""A quick GPU for HTTP tests: about a millisecond a step."""

LONG = 10_000
"""max_tokens for a request meant to run until the test ends it: over 10 s of
steps, and a few fit in the default KV cache."""

POLL_S = 0.005
WAIT_S = 10.0

SimFactory = Callable[..., Awaitable[SimServer]]


# -- helpers ----------------------------------------------------------------


async def eventually(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` until it holds; fail after a generous bound."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(POLL_S)


class SteppedGpu:
    """Fake `sleep` for the engine: each step blocks until the test releases it."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self._release: asyncio.Future[None] | None = None

    async def __call__(self, seconds: float) -> None:
        self.durations.append(seconds)
        self._release = asyncio.get_running_loop().create_future()
        await self._release

    @property
    def sleeping(self) -> bool:
        return self._release is not None and not self._release.done()

    async def settle(self) -> None:
        """Let the engine reach its next step (or park) and consumers run."""
        for _ in range(5):
            await asyncio.sleep(0)

    async def step(self, count: int = 1) -> None:
        for _ in range(count):
            await self.settle()
            assert self._release is not None
            assert self.sleeping, "engine is not in a step"
            self._release.set_result(None)
        await self.settle()


async def instant_gpu(seconds: float) -> None:
    """Fake `sleep` that takes no time: runs the model as fast as the loop allows."""
    await asyncio.sleep(0)


@pytest.fixture
async def gpu() -> SteppedGpu:
    return SteppedGpu()


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    """Engines a test makes; closed at teardown."""
    made: list[SimEngine] = []
    yield made
    for engine in made:
        await engine.close()


async def started(engines: list[SimEngine], config: SimConfig, **kwargs: Any) -> SimEngine:
    engine = SimEngine(config, **kwargs)
    engines.append(engine)
    await engine.start()
    return engine


@pytest.fixture
async def make_sim() -> AsyncIterator[SimFactory]:
    """Start sims on OS-chosen loopback ports; `FAST` plus overrides."""
    sims: list[SimServer] = []

    async def make(**overrides: Any) -> SimServer:
        sim = await start_sim(replace(FAST, **overrides))
        sims.append(sim)
        return sim

    yield make
    for sim in sims:
        await sim.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


def chat(max_tokens: int, *, stream: bool = False, usage: bool = False) -> dict[str, object]:
    body: dict[str, object] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Tell me about continuous batching."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def sse_data(response: aiohttp.ClientResponse) -> list[str]:
    """Payloads of the `data:` events of a stream, read line by line."""
    payloads = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payloads.append(line.removeprefix("data: "))
    return payloads


async def collect(seq: Sequence) -> list[int]:
    tokens: list[int] = []
    await seq.admitted()
    while chunk := await seq.next_tokens():
        tokens.extend(chunk)
    return tokens


# -- engine: scheduling, without sockets or wall time ----------------------------


async def test_engine_runs_at_most_slots_and_queues_the_rest(
    engines: list[SimEngine], gpu: SteppedGpu
) -> None:
    """slots=2, five sequences: two run, three wait FIFO; all finish, never more than two."""
    engine = await started(engines, replace(FAST, slots=2), sleep=gpu)
    seqs = [engine.submit(10, 3) for _ in range(5)]
    await gpu.settle()
    assert (engine.running, engine.waiting) == (2, 3)
    assert "2 running, 3 waiting" in repr(engine)
    assert [s.state for s in seqs] == [SequenceState.RUNNING] * 2 + [SequenceState.WAITING] * 3
    max_running = 0
    while engine.running or engine.waiting:
        max_running = max(max_running, engine.running)
        await gpu.step()
    stats = engine.stats()
    assert max_running == 2
    assert (stats.completed, stats.peak_running, stats.peak_waiting) == (5, 2, 5)
    assert stats.tokens_generated == 15
    # FIFO: the first two were admitted before the others.
    assert max(s.admitted_at for s in seqs[:2]) <= min(s.admitted_at for s in seqs[2:])
    assert not gpu.sleeping, "an idle engine parks instead of stepping"


async def test_engine_kv_capacity_limits_admission(
    engines: list[SimEngine], gpu: SteppedGpu
) -> None:
    """KV for 100 tokens, three sequences of 50: two run though slots are free; the third waits."""
    engine = await started(engines, replace(FAST, slots=8, kv_cache_tokens=100), sleep=gpu)
    first, second, third = (engine.submit(10, 40) for _ in range(3))
    await gpu.settle()
    assert (engine.running, engine.waiting) == (2, 1)
    assert engine.kv_cache_usage == 1.0
    await gpu.step(40)
    assert first.state is second.state is SequenceState.FINISHED
    assert third.state is SequenceState.RUNNING
    assert engine.kv_cache_usage == 0.5
    with pytest.raises(PromptTooLong):
        engine.submit(60, 41)


async def test_engine_step_time_model(engines: list[SimEngine], gpu: SteppedGpu) -> None:
    """A step costs decode_base + per_seq * batch, plus prefill for prompts admitted in it."""
    config = SimConfig(decode_base_ms=10.0, decode_per_seq_ms=2.0, prefill_ms_per_token=0.5)
    engine = await started(engines, config, sleep=gpu)
    engine.submit(100, 2)
    engine.submit(20, 2)
    await gpu.step(2)
    assert gpu.durations == [
        pytest.approx((10.0 + 2.0 * 2 + 0.5 * 120) / 1000),
        pytest.approx((10.0 + 2.0 * 2) / 1000),
    ]
    assert engine.stats().modelled_busy_s == pytest.approx(sum(gpu.durations))


async def test_engine_throughput_rises_with_batch(engines: list[SimEngine]) -> None:
    """Tokens per modelled GPU second are higher at batch 4 than batch 1; step time grows too."""
    rates = []
    for batch in (1, 4):
        engine = await started(engines, SimConfig(), sleep=instant_gpu)
        seqs = [engine.submit(40, 32) for _ in range(batch)]
        await asyncio.gather(*(collect(seq) for seq in seqs))
        stats = engine.stats()
        assert stats.tokens_generated == 32 * batch
        rates.append(stats.tokens_generated / stats.modelled_busy_s)
    assert rates[1] > 2 * rates[0]
    engine = engines[0]
    assert engine.step_ms(4) > engine.step_ms(1)  # latency per token climbs with the batch
    # Throughput flattens: the gain from 32 to 64 is far smaller than from 1 to 32.
    throughput = [b / engine.step_ms(b) for b in (1, 32, 64)]
    assert throughput[2] - throughput[1] < (throughput[1] - throughput[0]) / 4


async def test_engine_abort_frees_slot_and_kv(engines: list[SimEngine], gpu: SteppedGpu) -> None:
    """Aborting a running and a waiting sequence frees both at once; consumers are told."""
    engine = await started(engines, replace(FAST, slots=1), sleep=gpu)
    running = engine.submit(10, LONG)
    waiting = engine.submit(10, 5)
    await gpu.settle()
    engine.abort(waiting)
    engine.abort(running)
    engine.abort(running)  # idempotent
    assert (engine.running, engine.waiting, engine.kv_cache_usage) == (0, 0, 0.0)
    assert engine.stats().aborted == 2
    with pytest.raises(SequenceAborted):
        await running.next_tokens()
    with pytest.raises(SequenceAborted):
        await waiting.admitted()


async def test_engine_drops_sequences_whose_client_is_gone(
    engines: list[SimEngine], gpu: SteppedGpu
) -> None:
    """The client_gone probe is checked each step, for running and waiting sequences alike."""
    engine = await started(engines, replace(FAST, slots=1), sleep=gpu)
    gone = {"running": False, "waiting": False}
    engine.submit(10, LONG, client_gone=lambda: gone["running"])
    engine.submit(10, LONG, client_gone=lambda: gone["waiting"])
    await gpu.step()
    gone["waiting"] = True
    await gpu.step()
    assert (engine.running, engine.waiting, engine.stats().aborted) == (1, 0, 1)
    gone["running"] = True
    await gpu.step()
    assert (engine.running, engine.waiting, engine.stats().aborted) == (0, 0, 2)
    assert not gpu.sleeping


async def test_engine_max_waiting_refuses(engines: list[SimEngine], gpu: SteppedGpu) -> None:
    """With max_waiting=1 a second waiting sequence is refused at once."""
    engine = await started(engines, replace(FAST, slots=1, max_waiting=1), sleep=gpu)
    engine.submit(10, LONG)
    await gpu.settle()
    engine.submit(10, 5)
    with pytest.raises(EngineFull):
        engine.submit(10, 5)
    assert engine.stats().rejected == 1


async def test_engine_same_seed_same_tokens(engines: list[SimEngine]) -> None:
    """Token ids depend on the seed and submit order only."""
    outputs = []
    for seed in (7, 7, 8):
        engine = await started(engines, replace(FAST, seed=seed), sleep=instant_gpu)
        seqs = [engine.submit(5, 12) for _ in range(3)]
        outputs.append(await asyncio.gather(*(collect(s) for s in seqs)))
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]
    assert all(0 <= t < len(VOCABULARY) for seq in outputs[0] for t in seq)


# -- faults: values and dice ------------------------------------------------


def test_faults_validation() -> None:
    """Bad values name their field; unknown fields are refused, not ignored."""
    base = Faults()
    assert update_faults(base, {"error_rate": 0.5, "error_status": 429}).error_rate == 0.5
    for changes in (
        {"error_rate": 1.5},
        {"error_rate": True},
        {"error_status": 200},
        {"hang_before_first_byte_ms": -2},
        {"reset_mid_stream_after_tokens": -1},
        {"reset_mid_stream_after_tokens": 1.5},
        {"slow_accept_ms": "10"},
        {"no_such_fault": 1},
    ):
        with pytest.raises(FaultsError):
            update_faults(base, changes)


def test_fault_dice_are_seeded() -> None:
    """The same seed picks the same victims; the rate is respected roughly."""
    faults = Faults(error_rate=0.5)
    rolls = [[dice.roll_error(faults) for _ in range(200)] for dice in (FaultDice(3), FaultDice(3))]
    assert rolls[0] == rolls[1]
    assert 60 < sum(rolls[0]) < 140


# -- HTTP: wire formats ------------------------------------------------------------


async def test_chat_non_stream(make_sim: SimFactory, session: aiohttp.ClientSession) -> None:
    """A chat completion has max_tokens tokens, usage, and the TGI-style timing headers."""
    sim = await make_sim()
    async with session.post(f"{sim.url}/v1/chat/completions", json=chat(7)) as response:
        assert response.status == 200
        body = await response.json()
        headers = response.headers
    choice = body["choices"][0]
    assert body["object"] == "chat.completion"
    assert body["model"] == "sim-model"
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    assert len(choice["message"]["content"].split()) == 7
    prompt_tokens = estimate_tokens("Tell me about continuous batching.")
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 7,
        "total_tokens": prompt_tokens + 7,
    }
    assert headers["x-prompt-tokens"] == str(prompt_tokens)
    assert headers["x-generated-tokens"] == "7"
    assert int(headers["x-queue-time"]) >= 0
    assert int(headers["x-inference-time"]) >= 0


@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_stream(
    make_sim: SimFactory, session: aiohttp.ClientSession, include_usage: bool
) -> None:
    """Role-only first chunk, one chunk per token, a finish chunk, usage if asked, [DONE]."""
    sim = await make_sim()
    body = chat(5, stream=True, usage=include_usage)
    async with session.post(f"{sim.url}/v1/chat/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        assert "x-queue-time" in response.headers
        assert "x-prompt-tokens" in response.headers
        assert "x-inference-time" not in response.headers
        payloads = await sse_data(response)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 5
    assert chunks[1:6] == tokens
    finish = chunks[6]
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["choices"][0]["delta"] == {}
    if include_usage:
        assert len(chunks) == 8
        assert chunks[7]["choices"] == []
        assert chunks[7]["usage"]["completion_tokens"] == 5
    else:
        assert len(chunks) == 7
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_completions(make_sim: SimFactory, session: aiohttp.ClientSession) -> None:
    """/v1/completions, non-stream and stream, with max_completion_tokens honoured."""
    sim = await make_sim()
    url = f"{sim.url}/v1/completions"
    async with session.post(url, json={"prompt": "x" * 40, "max_tokens": 4}) as response:
        body = await response.json()
        assert response.headers["x-generated-tokens"] == "4"
    assert body["object"] == "text_completion"
    assert len(body["choices"][0]["text"].split()) == 4
    assert body["usage"]["prompt_tokens"] == 10
    stream_body = {"prompt": "hi", "max_completion_tokens": 3, "stream": True}
    async with session.post(url, json=stream_body) as response:
        payloads = await sse_data(response)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]"
    assert [bool(c["choices"][0]["text"]) for c in chunks] == [True, True, True, False]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_tgi_generate_and_stream(
    make_sim: SimFactory, session: aiohttp.ClientSession
) -> None:
    """TGI /generate answers generated_text with headers; /generate_stream ends with it."""
    sim = await make_sim()
    request = {"inputs": "What is a KV cache?", "parameters": {"max_new_tokens": 6}}
    async with session.post(f"{sim.url}/generate", json=request) as response:
        body = await response.json()
        assert response.headers["x-generated-tokens"] == "6"
        assert "x-inference-time" in response.headers
    assert len(body["generated_text"].split()) == 6
    async with session.post(f"{sim.url}/generate_stream", json=request) as response:
        assert "x-queue-time" in response.headers
        events = [json.loads(p) for p in await sse_data(response)]
    assert len(events) == 6
    assert all(e["token"]["text"] for e in events)
    assert [e["generated_text"] for e in events[:-1]] == [None] * 5
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert events[-1]["details"]["finish_reason"] == "length"


async def test_health_models_and_default_length(
    make_sim: SimFactory, session: aiohttp.ClientSession
) -> None:
    """/health, /v1/models with the configured name, and default_max_tokens when none is set."""
    sim = await make_sim(model_name="tiny-llm", default_max_tokens=3)
    async with session.get(f"{sim.url}/health") as response:
        assert await response.json() == {"status": "ok"}
    async with session.get(f"{sim.url}/v1/models") as response:
        assert [m["id"] for m in (await response.json())["data"]] == ["tiny-llm"]
    body = {"messages": [{"role": "user", "content": "hi"}]}
    async with session.post(f"{sim.url}/v1/chat/completions", json=body) as response:
        assert (await response.json())["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("path", "payload", "fragment"),
    [
        ("/v1/chat/completions", b"{not json", "not valid JSON"),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"content": "x"}], "max_tokens": 0}',
            "max_tokens",
        ),
        ("/v1/completions", b'{"prompt": 5}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 70000}', "KV cache"),
        ("/generate", b'{"inputs": 1}', "inputs"),
    ],
)
async def test_bad_requests_get_openai_errors(
    make_sim: SimFactory,
    session: aiohttp.ClientSession,
    path: str,
    payload: bytes,
    fragment: str,
) -> None:
    """Invalid bodies are 400 with an OpenAI-style error naming the problem."""
    sim = await make_sim()
    headers = {"Content-Type": "application/json"}
    async with session.post(f"{sim.url}{path}", data=payload, headers=headers) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error"
    assert sim.engine.stats().submitted == 0


async def test_same_seed_same_text(make_sim: SimFactory, session: aiohttp.ClientSession) -> None:
    """Two sims with one seed answer the same request order with the same text."""
    texts = []
    for seed in (11, 11, 12):
        sim = await make_sim(seed=seed)
        async with session.post(f"{sim.url}/v1/chat/completions", json=chat(20)) as response:
            texts.append((await response.json())["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


# -- HTTP: scheduling seen from outside ---------------------------------------------


async def test_slots_bound_concurrency_over_http(
    make_sim: SimFactory, session: aiohttp.ClientSession
) -> None:
    """slots=2, two long streams and three more requests: the three wait, then run two at once."""
    sim = await make_sim(slots=2)
    engine = sim.engine
    url = f"{sim.url}/v1/chat/completions"
    seen_running: list[int] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            async with session.get(f"{sim.url}/sim/stats") as response:
                seen_running.append((await response.json())["running"])
            await asyncio.sleep(POLL_S)

    async def one() -> tuple[int, int]:
        async with session.post(url, json=chat(20)) as response:
            await response.read()
            return response.status, int(response.headers["x-queue-time"])

    watcher = asyncio.create_task(watch())
    try:
        # Stream headers come only once admitted: both blockers run after these awaits.
        blockers = [await session.post(url, json=chat(LONG, stream=True)) for _ in range(2)]
        assert engine.running == 2
        queued = [asyncio.create_task(one()) for _ in range(3)]
        await eventually(lambda: engine.waiting == 3, "three requests queued")
        queued_since = time.monotonic()
        steps = engine.stats().steps
        await eventually(lambda: engine.stats().steps >= steps + 5, "five more steps")
        assert (engine.running, engine.waiting) == (2, 3)
        for blocker in blockers:
            blocker.close()
        waited_ms = (time.monotonic() - queued_since) * 1000
        results = await asyncio.gather(*queued)
    finally:
        done.set()
        await watcher
    assert [status for status, _ in results] == [200] * 3
    # Each queued request waited at least from "seen queued" to "blockers left".
    assert all(queue_ms >= int(waited_ms) - 1 for _, queue_ms in results)
    assert max(seen_running) <= 2
    async with session.get(f"{sim.url}/sim/stats") as response:
        stats = await response.json()
    assert (stats["peak_running"], stats["peak_waiting"]) == (2, 3)
    assert (stats["completed"], stats["aborted"], stats["running"]) == (3, 2, 0)


async def test_max_waiting_answers_503_at_once(
    make_sim: SimFactory, session: aiohttp.ClientSession
) -> None:
    """With slots=1 and max_waiting=0, a second request is refused with 503 while one runs."""
    sim = await make_sim(slots=1, max_waiting=0)
    url = f"{sim.url}/v1/chat/completions"
    async with session.post(url, json=chat(LONG, stream=True)) as running:
        assert running.status == 200
        async with session.post(url, json=chat(5)) as refused:
            assert refused.status == 503
            assert "waiting queue is full" in (await refused.json())["error"]["message"]
    assert sim.engine.stats().rejected == 1


async def test_metrics_have_vllm_names_and_values(
    make_sim: SimFactory, session: aiohttp.ClientSession
) -> None:
    """/metrics reports running, waiting and KV usage as vLLM names them, then token counters."""
    sim = await make_sim(slots=1, kv_cache_tokens=LONG * 2)
    url = f"{sim.url}/v1/chat/completions"
    async with session.post(url, json=chat(LONG, stream=True)):
        queued = asyncio.create_task(session.post(url, json=chat(5)))
        await eventually(lambda: sim.engine.waiting == 1, "second request waiting")
        async with session.get(f"{sim.url}/metrics") as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            samples = {
                sample.name: sample
                for family in text_string_to_metric_families(await response.text())
                for sample in family.samples
            }
        queued.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await queued
    assert samples["vllm:num_requests_running"].value == 1
    assert samples["vllm:num_requests_waiting"].value == 1
    prompt_tokens = estimate_tokens("Tell me about continuous batching.")
    expected_kv = (prompt_tokens + LONG) / (LONG * 2)
    assert samples["vllm:kv_cache_usage_perc"].value == pytest.approx(expected_kv)
    assert samples["vllm:kv_cache_usage_perc"].labels == {"model_name": "sim-model"}
    await eventually(lambda: sim.engine.stats().aborted == 2, "both requests aborted")
    stats = sim.engine.stats()
    async with session.get(f"{sim.url}/metrics") as response:
        text = await response.text()
    assert f'vllm:prompt_tokens_total{{model_name="sim-model"}} {stats.prompt_tokens:.1f}' in text
    generated = (
        f'vllm:generation_tokens_total{{model_name="sim-model"}} {stats.tokens_generated:.1f}'
    )
    assert generated in text
    assert 'vllm:num_requests_running{model_name="sim-model"} 0.0' in text


# -- HTTP: client disconnects ------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("where", ["running", "waiting"])
async def test_client_disconnect_aborts_the_sequence(
    make_sim: SimFactory, session: aiohttp.ClientSession, stream: bool, where: str
) -> None:
    """A client that leaves, running or queued, streaming or not, frees its slot at once."""
    sim = await make_sim(slots=1)
    engine = sim.engine
    url = f"{sim.url}/v1/chat/completions"
    blocker: aiohttp.ClientResponse | None = None
    if where == "waiting":
        blocker = await session.post(url, json=chat(LONG, stream=True))
        await eventually(lambda: engine.running == 1, "blocker running")
    request = asyncio.create_task(session.post(url, json=chat(LONG, stream=stream)))
    if where == "running":
        await eventually(lambda: engine.running == 1 and engine.stats().tokens_generated > 3, "run")
    else:
        await eventually(lambda: engine.waiting == 1, "queued")
    if stream and where == "running":
        response = await request
        await response.content.readline()
        response.close()
    else:
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
    await eventually(lambda: engine.stats().aborted == 1, "sequence aborted")
    expected_running = 1 if blocker is not None else 0
    await eventually(lambda: engine.running == expected_running, "slot freed")
    assert engine.waiting == 0
    if blocker is not None:
        blocker.close()
        await eventually(lambda: engine.running == 0, "blocker aborted")
    await eventually(lambda: sim.state.in_flight == 0, "handlers finished")
    assert engine.kv_cache_usage == 0.0


# -- HTTP: faults ------------------------------------------------------------------


async def test_error_rate_one_gives_configured_status(
    make_sim: SimFactory, session: aiohttp.ClientSession
) -> None:
    """error_rate=1: every inference request gets the status, Retry-After, an OpenAI error."""
    sim = await make_sim(faults=Faults(error_rate=1.0, error_status=429, error_retry_after_s=1.5))
    async with session.post(f"{sim.url}/v1/chat/completions", json=chat(5)) as response:
        assert response.status == 429
        assert response.headers["Retry-After"] == "2"
        assert (await response.json())["error"]["type"] == "sim_injected_error"
    async with session.get(f"{sim.url}/health") as response:
        assert response.status == 200  # faults hit inference routes only
    async with session.get(f"{sim.url}/sim/stats") as response:
        stats = await response.json()
    assert (stats["errors_injected"], stats["requests_total"]) == (1, 1)
    assert sim.engine.stats().submitted == 0


async def test_hang_then_disconnect_leaves_nothing_running(
    make_sim: SimFactory, session: aiohttp.ClientSession
) -> None:
    """A request hanging forever stops when its client leaves; no handler or slot remains."""
    sim = await make_sim(faults=Faults(hang_before_first_byte_ms=-1))
    request = asyncio.create_task(session.post(f"{sim.url}/v1/chat/completions", json=chat(5)))
    await eventually(lambda: sim.state.in_flight == 1, "request hanging")
    assert (sim.engine.running, sim.engine.waiting) == (0, 0)
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request
    await eventually(lambda: sim.state.in_flight == 0, "hang noticed the disconnect")
    assert sim.engine.stats().submitted == 0


async def test_finite_hang_and_slow_accept_delay_the_answer(
    make_sim: SimFactory, session: aiohttp.ClientSession
) -> None:
    """hang_before_first_byte_ms and slow_accept_ms delay the response by at least that long."""
    sim = await make_sim(faults=Faults(hang_before_first_byte_ms=100, slow_accept_ms=50))
    started_at = time.monotonic()
    async with session.post(f"{sim.url}/v1/chat/completions", json=chat(2)) as response:
        assert response.status == 200
    assert time.monotonic() - started_at >= 0.15


async def test_reset_mid_stream(make_sim: SimFactory, session: aiohttp.ClientSession) -> None:
    """After N tokens the connection is reset: the client sees N tokens, then a payload error."""
    sim = await make_sim()
    await sim.set_faults(reset_mid_stream_after_tokens=3)
    contents: list[str] = []

    async def read_tokens(response: aiohttp.ClientResponse) -> None:
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
                if delta.get("content"):
                    contents.append(delta["content"])

    url = f"{sim.url}/v1/chat/completions"
    async with session.post(url, json=chat(10, stream=True)) as response:
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await read_tokens(response)
    assert len(contents) == 3
    await eventually(lambda: sim.engine.running == 0, "reset stream aborted")
    assert sim.engine.stats().aborted == 1
    assert sim.state.resets_injected == 1


async def test_refuse_connections_and_come_back_on_same_port(
    make_sim: SimFactory, session: aiohttp.ClientSession
) -> None:
    """Refusal gives connect errors (even to a keep-alive client); the sim returns on its port."""
    sim = await make_sim()
    port = sim.port
    async with session.get(f"{sim.url}/health") as response:
        assert response.status == 200  # leaves a pooled keep-alive connection
    await sim.refuse_for(None)
    assert not sim.accepting
    with pytest.raises(aiohttp.ClientConnectionError):
        await session.get(f"{sim.url}/health")
    await sim.accept()
    assert sim.port == port
    async with session.get(f"{sim.url}/health") as response:
        assert response.status == 200

    # The timed variant, asked for over HTTP: ends by itself and clears the field.
    async with session.post(f"{sim.url}/sim/faults", json={"refuse_connections_ms": 200}) as r:
        assert r.status == 200
    with pytest.raises(aiohttp.ClientConnectorError):
        await session.get(f"{sim.url}/health")
    await eventually(lambda: sim.accepting, "listening again")
    async with session.get(f"{sim.url}/sim/faults") as response:
        assert (await response.json())["refuse_connections_ms"] == 0
    assert sim.port == port


async def test_fault_endpoint_validates_and_round_trips(
    make_sim: SimFactory, session: aiohttp.ClientSession
) -> None:
    """POST /sim/faults applies a partial update; bad bodies are 400 and change nothing."""
    sim = await make_sim()
    url = f"{sim.url}/sim/faults"
    for payload in (b"{oops", b"[1, 2]", b'{"error_rate": 2}', b'{"errror_rate": 0.1}'):
        async with session.post(url, data=payload) as response:
            assert response.status == 400
            assert (await response.json())["error"]["message"]
    async with session.get(url) as response:
        assert await response.json() == Faults().to_json()
    async with session.post(url, json={"error_rate": 0.25, "error_status": 500}) as response:
        assert (await response.json())["error_rate"] == 0.25
    assert sim.faults == Faults(error_rate=0.25, error_status=500)
    async with session.delete(url) as response:
        assert await response.json() == Faults().to_json()


async def test_app_under_pytest_server(aiohttp_client: AiohttpClient) -> None:
    """build_sim_app runs under any runner; without start_sim it cannot refuse connections."""
    client = await aiohttp_client(build_sim_app(FAST))
    response = await client.post("/v1/chat/completions", json=chat(3))
    assert (await response.json())["usage"]["completion_tokens"] == 3
    response = await client.post("/sim/faults", json={"refuse_connections_ms": 100})
    assert response.status == 400
    assert "start_sim" in (await response.json())["error"]["message"]


async def test_shutdown_ends_hanging_and_streaming_requests(session: aiohttp.ClientSession) -> None:
    """close() aborts in-flight work instead of waiting out its shutdown timeout."""
    sim = await start_sim(replace(FAST, slots=1))
    url = f"{sim.url}/v1/chat/completions"
    stream = await session.post(url, json=chat(LONG, stream=True))
    await sim.set_faults(hang_before_first_byte_ms=-1)

    async def hang() -> int:
        async with session.post(url, json=chat(5)) as response:
            return response.status

    hanging = asyncio.create_task(hang())
    await eventually(lambda: sim.state.in_flight == 2, "both in flight")
    started_at = time.monotonic()
    await sim.close()
    assert time.monotonic() - started_at < 4.0  # SHUTDOWN_TIMEOUT_S is 5
    assert await hanging == 503
    with contextlib.suppress(aiohttp.ClientError):
        await stream.read()
    stream.close()
    assert sim.engine.stats().aborted == 1


# -- CLI ----------------------------------------------------------------------------


def test_cli_flags_build_the_config() -> None:
    """Flags map onto SimConfig and Faults; bad values fail with the field's name."""
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    ns = parser.parse_args(
        ["--port", "0", "--slots", "3", "--error-rate", "0.2", "--reset-after-tokens", "4"]
    )
    config = config_from_args(ns)
    assert (config.slots, config.faults.error_rate) == (3, 0.2)
    assert config.faults.reset_mid_stream_after_tokens == 4
    assert config.max_waiting is None
    with pytest.raises(ValueError, match="error_rate"):
        config_from_args(parser.parse_args(["--port", "0", "--error-rate", "3"]))


async def test_run_sim_serves_until_sigterm(session: aiohttp.ClientSession) -> None:
    """run_sim in a subprocess: announces its URL, serves, exits 0 on SIGTERM."""
    code = (
        "import argparse, sys\n"
        "from proxy.sim.cli import add_sim_arguments, run_sim\n"
        "parser = argparse.ArgumentParser()\n"
        "add_sim_arguments(parser)\n"
        "sys.exit(run_sim(parser.parse_args(sys.argv[1:])))\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        "--port",
        "0",
        "--slots",
        "2",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        line = (await asyncio.wait_for(process.stderr.readline(), WAIT_S)).decode()
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:")
        async with session.post(f"{url}/v1/chat/completions", json=chat(2)) as response:
            assert response.status == 200
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), WAIT_S) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
