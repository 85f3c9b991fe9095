"""Token quotas' pure parts: estimates, headers, the usage request and its removal."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.batch_usage import BatchUsage
from proxy.clock import FakeClock
from proxy.engine_routes import samples_per_prompt
from proxy.ratelimit_headers import go_duration, request_headers, token_headers
from proxy.sse import SseMeter, usage_from_body
from proxy.sse_usage import UsageStripper
from proxy.state.quota import Charge, LocalTokenQuotas, QuotaLimits, QuotaRemaining
from proxy.token_quota import Held, TokenQuotas, actual_tokens, quota_estimate
from proxy.usage_request import request_usage


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.017, "17ms"), (1, "1s"), (59.2, "1m0s"), (360, "6m0s"), (86_399, "23h59m59s")],
)
def test_go_duration(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


@pytest.mark.parametrize(
    ("limits", "remaining", "expected"),
    [
        # Only a minute quota: 600 left of 1000 refill in 24 s.
        (QuotaLimits(per_minute=1000), QuotaRemaining(600, 5, 80.0), ("1000", "600", "24s")),
        # Only a day quota: resets at midnight; untouched, nothing to reset.
        (QuotaLimits(per_day=500), QuotaRemaining(None, 100, 90.0), ("500", "100", "1m30s")),
        (QuotaLimits(per_day=500), QuotaRemaining(None, 500, 90.0), ("500", "500", "0s")),
        # Both: the window with fewer tokens left binds.
        (QuotaLimits(1000, 50_000), QuotaRemaining(400, 45_000, 9.0), ("1000", "400", "36s")),
        (QuotaLimits(1000, 50_000), QuotaRemaining(1000, 30, 61.0), ("50000", "30", "1m1s")),
    ],
)
def test_token_headers_follow_the_binding_window(
    limits: QuotaLimits, remaining: QuotaRemaining, expected: tuple[str, str, str]
) -> None:
    headers = token_headers(limits, remaining)
    got = tuple(headers[f"x-ratelimit-{k}-tokens"] for k in ("limit", "remaining", "reset"))
    assert got == expected


def test_request_headers_from_the_bucket() -> None:
    """burst 10 at 2/s with 3.5 tokens: limit 10, 3 left, full again in 3.25 s (4s)."""
    assert request_headers(3.5, 10.0, 2.0) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "4s",
    }


@pytest.mark.parametrize(
    ("doc", "output", "count", "expected"),
    [
        ({"max_tokens": 100}, 256, "total", 40 // 4 + 100),
        ({"max_completion_tokens": 7}, 256, "completion", 7),
        ({"parameters": {"max_new_tokens": 9}}, 256, "total", 10 + 9),
        ({}, 31.2, "total", 10 + 32),  # the tenant's mean output, rounded up
        ({"max_tokens": True}, 12, "completion", 12),  # not a number: the mean
        ({"max_tokens": 100_000}, 256, "completion", 100_000),  # no cap: the bound holds
        ({"n_predict": 20}, 256, "completion", 20),  # llama.cpp's own API
        ({"n_predict": -1}, 12, "completion", 12),  # its "until the end": the mean
        ({"sampling_params": {"max_new_tokens": 6}}, 256, "completion", 6),  # SGLang
        ({"max_tokens": 10, "n": 3}, 256, "completion", 30),  # n choices generated
        ({"max_tokens": 10, "n": 2, "best_of": 4}, 256, "completion", 40),  # vLLM best_of
        ({"parameters": {"max_new_tokens": 5, "best_of": 2}}, 256, "completion", 10),  # TGI
        ({"sampling_params": {"max_new_tokens": 5, "n": 3}}, 256, "completion", 15),  # SGLang
        ({"n": 4}, 12, "completion", 12),  # no limit: the mean already counts the choices
        # several limits: the largest (llama.cpp takes n_predict over max_tokens)
        ({"max_tokens": 1, "n_predict": 50}, 256, "completion", 50),
        # n_predict -1 ("until the end") wins over max_tokens on llama.cpp: the mean
        ({"max_tokens": 9, "n_predict": -1}, 256, "completion", 256),
        ({"max_tokens": 9, "n_predict": -2}, 256, "completion", 256),
        # SGLang's batch with sampling_params per prompt: each one's limit times its n
        (
            {
                "text": ["a", "b"],
                "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 5, "n": 2}],
            },
            256,
            "completion",
            13,
        ),
        ({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 3}, {}]}, 7, "completion", 7),
        # a batch: one answer per prompt of the list (a list holding a number is one prompt)
        ({"prompt": ["a", "b", "c"], "n_predict": 4}, 256, "completion", 12),  # llama.cpp
        ({"prompt": [[1, 2], [3]], "max_tokens": 4, "n": 2}, 256, "completion", 16),  # OpenAI
        ({"prompt": [1, 2, 3], "max_tokens": 4}, 256, "completion", 4),  # token ids: one
        ({"prompt": [12, "x", 13], "n_predict": 4}, 256, "completion", 4),  # llama.cpp's mix
        ({"text": ["a", "b"], "sampling_params": {"max_new_tokens": 5}}, 256, "completion", 10),
        (
            {"input_ids": [[1], [2], [3]], "sampling_params": {"max_new_tokens": 2}},
            256,
            "completion",
            6,
        ),
    ],
)
def test_quota_estimate(doc: dict[str, Any], output: float, count: Any, expected: int) -> None:
    assert quota_estimate(40, doc, output, count) == expected


@pytest.mark.parametrize(
    ("count", "status", "prompt", "completion", "expected"),
    [
        ("total", 200, 12, 30, 42),
        ("total", 200, None, 30, 25 + 30),  # no prompt count: the estimate
        ("completion", 200, 12, 30, 30),
        ("total", 200, None, None, 25),  # answered, nothing generated
        ("total", 400, 12, 30, 0),  # the engine refused it: nothing charged
        ("total", 0, None, None, 0),  # never reached a replica
    ],
)
def test_actual_tokens(
    count: Any, status: int, prompt: int | None, completion: int | None, expected: int
) -> None:
    assert actual_tokens(count, 25, status, prompt, completion) == expected


async def test_settle_corrects_once() -> None:
    """A second settlement of the same charge changes nothing."""
    clock = FakeClock(start=1_796_166_000.0)
    quotas = TokenQuotas(LocalTokenQuotas(clock), clock)
    limits = QuotaLimits(per_day=1000)
    charge, _ = await quotas.charge("acme", 300, limits)
    assert isinstance(charge, Charge)
    held = Held(charge, "total", 10)
    remaining = await quotas.settle(held, 120)
    assert remaining is not None and remaining.day == 880
    assert await quotas.settle(held, 0) is None
    assert (await quotas.remaining("acme", limits)).day == 880
    assert quotas.use("acme", limits) == {
        "used": 120, "limit": 1000, "unit": "tokens today",
        "day": {"limit": 1000, "used": 120, "remaining": 880},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}),
        (
            {"stream": True, "stream_options": {"include_usage": False, "x": 1}},
            {"stream": True, "stream_options": {"include_usage": True, "x": 1}},
        ),
        ({"stream": True, "stream_options": {"include_usage": True}}, None),  # asked already
        ({"stream": False}, None),
        ({"stream": True, "stream_options": "yes"}, None),  # the engine judges that body
    ],
)
def test_request_usage(doc: dict[str, Any], expected: dict[str, Any] | None) -> None:
    assert request_usage(doc) == expected


def _event(doc: dict[str, Any], sep: tuple[str, str] = (",", ":")) -> bytes:
    return b"data: " + json.dumps(doc, separators=sep).encode() + b"\n\n"


def _openai_stream(with_usage: bool, sep: tuple[str, str] = (",", ":")) -> bytes:
    """OpenAI's layout: with include_usage every chunk has ``usage: null`` (first or last
    key here, both placements), then a usage-only chunk."""
    events = []
    for i, delta in enumerate([{"role": "assistant"}, {"content": "a"}, {"content": "b"}, {}]):
        chunk: dict[str, Any] = {}
        if with_usage and i % 2:
            chunk["usage"] = None
        chunk.update({"id": "x", "choices": [{"index": 0, "delta": delta}]})
        if with_usage and not i % 2:
            chunk["usage"] = None
        events.append(_event(chunk, sep))
    events.insert(1, b": keep-alive\n\n")
    if with_usage:
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        events.append(_event({"id": "x", "choices": [], "usage": usage}, sep))
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


@pytest.mark.parametrize("sep", [(",", ":"), (", ", ": ")])
def test_stripper_gives_the_stream_without_usage_at_every_split(sep: tuple[str, str]) -> None:
    """Cut anywhere into two or three pieces, the stream with usage becomes, byte for byte,
    the stream without it, and the usage chunk is counted as stripped."""
    with_usage, without = _openai_stream(True, sep), _openai_stream(False, sep)
    assert with_usage != without
    for cut in range(len(with_usage) + 1):
        for pieces in ([cut], [cut // 2, cut]):
            stripper = UsageStripper()
            out, start = b"", 0
            for end in [*pieces, len(with_usage)]:
                out += stripper.feed(with_usage[start:end])
                start = end
            out += stripper.flush()
            assert out == without, cut
            assert stripper.stripped == 1


def test_stripper_keeps_usage_the_client_gets_anyway() -> None:
    """A usage object inside a chunk with choices (llama.cpp's completions) is the engine's
    own: kept. A stream with bare CR line ends passes through as it is (one framed
    with CRLF is stripped: tests/test_stream_failures.py)."""
    chunk = _event({"choices": [{"text": ""}], "usage": {"completion_tokens": 3}})
    assert UsageStripper().feed(chunk) == chunk
    bare_cr = b'data: {"choices":[],"usage":{"x":1}}\r\r'
    assert UsageStripper().feed(bare_cr) == bare_cr


def test_meter_reads_llama_cpp_timings_from_the_last_chunk() -> None:
    """llama-server's stream without include_usage: no usage, but its last chunk's timings
    give the completion (predicted_n) and the prompt (prompt_n + cache_n)."""
    meter = SseMeter()
    meter.feed(_event({"choices": [{"delta": {"content": "a"}}]}), 1.0)
    meter.feed(_event({"choices": [{"delta": {"content": "b"}}]}), 1.1)
    timings = {"cache_n": 29, "prompt_n": 1, "predicted_n": 5}
    meter.feed(_event({"choices": [{"delta": {}}], "timings": timings}), 1.2)
    meter.feed(b"data: [DONE]\n\n", 1.3)
    meter.finish()
    assert (meter.input_tokens, meter.output_tokens) == (30, 5)


def test_meter_reads_tgi_details_from_the_last_event() -> None:
    meter = SseMeter()
    meter.feed(_event({"token": {"text": "a"}}), 1.0)
    meter.feed(_event({"token": {"text": "b"}, "details": {"generated_tokens": 2}}), 1.1)
    meter.finish()
    assert meter.output_tokens == 2


def test_meter_reads_llama_cpp_native_counts_from_the_last_event() -> None:
    """llama.cpp's own ``/completion`` stream: ``content`` at the top of each event, and
    running counts in every one; the last event's are the answer's, not the first's."""
    meter = SseMeter()
    meter.feed(_event({"content": "", "stop": False, "tokens_predicted": 0}), 1.0)
    assert meter.first_token_at is None  # nothing generated yet
    for i, text in enumerate(["a", "b", "c"], start=1):
        meter.feed(_event({"content": text, "stop": False, "tokens_predicted": i}), 1.0 + i)
    assert meter.first_token_at == 2.0
    last = {"content": "", "stop": True, "tokens_predicted": 3, "tokens_evaluated": 7,
            "timings": {"prompt_n": 1, "cache_n": 6, "predicted_n": 3}}  # fmt: skip
    meter.feed(_event(last), 5.0)
    meter.finish()
    assert (meter.input_tokens, meter.output_tokens) == (7, 3)


def test_meter_reads_sglang_meta_info_from_the_last_event() -> None:
    """SGLang's ``/generate`` stream: the text so far in each event, ``meta_info`` counts."""
    meter = SseMeter()
    for i, text in enumerate(["a", "ab", "abc", "abcd"], start=1):
        meta = {"prompt_tokens": 9, "completion_tokens": i}
        meter.feed(_event({"text": text, "meta_info": meta, "index": 0}), float(i))
    meter.feed(b"data: [DONE]\n\n", 5.0)
    meter.finish()
    assert meter.first_token_at == 1.0
    assert (meter.input_tokens, meter.output_tokens) == (9, 4)


def test_meter_reads_a_one_event_stream() -> None:
    """An answer of one event (the first token is also the last): its counts are read."""
    meter = SseMeter()
    meter.feed(_event({"content": "a", "stop": True, "tokens_predicted": 1,
                       "tokens_evaluated": 4}), 1.0)  # fmt: skip
    meter.finish()
    assert (meter.input_tokens, meter.output_tokens) == (4, 1)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}', (3, 4)),
        # SGLang's /generate
        (b'{"text":"x","meta_info":{"prompt_tokens":5,"completion_tokens":6}}', (5, 6)),
        # llama.cpp's /completion
        (b'{"content":"x","tokens_predicted":8,"tokens_evaluated":2,"timings":{}}', (2, 8)),
        # a count's name inside a string value is escaped, never read
        (b'{"content":"\\"tokens_predicted\\":9","stop":true}', (None, None)),
        (b'{"content":"x"}', (None, None)),
        # a batch: every answer's counts (llama.cpp's /completion, SGLang's /generate)
        (
            b' [{"tokens_predicted":3,"tokens_evaluated":2},{"tokens_predicted":4,'
            b'"tokens_evaluated":5}]',
            (7, 7),
        ),
        (
            b'[{"text":"a","meta_info":{"prompt_tokens":1,"completion_tokens":2}},'
            b'{"text":"b","meta_info":{"prompt_tokens":3,"completion_tokens":4}}]',
            (4, 6),
        ),
        (b'[{"index":0,"embedding":[[0.5]]}]', (None, None)),
    ],
)
def test_usage_from_a_whole_body(body: bytes, expected: tuple[int | None, int | None]) -> None:
    assert usage_from_body(body) == expected


def test_batch_usage_reads_counts_cut_across_chunks() -> None:
    """A batch answer fed in chunks of every size, names and digits cut anywhere: each
    count is read once, the same as from the whole answer."""
    item = b'{"content":"x","tokens_predicted":123,"tokens_evaluated":45,"generation_settings":{}}'
    body = b"[" + b",".join([item] * 7) + b"]"
    for size in (1, 2, 3, 7, 16, 50, len(body)):
        counts = BatchUsage()
        for start in range(0, len(body), size):
            counts.feed(body[start : start + size])
        assert counts.finish() == (7 * 45, 7 * 123), size


def test_meter_sums_a_batch_streams_answers() -> None:
    """llama.cpp's ``/completion`` with a list of prompts streams their answers
    interleaved, each event with its ``index`` and that answer's running counts (after
    a ``null`` event): the stream used the sum of each answer's last counts."""
    meter = SseMeter()
    meter.feed(b"data: null\n\n", 0.5)
    for step in (1, 2, 3):
        for index, prompt in ((1, 4), (0, 3)):
            meter.feed(_event({"index": index, "content": "t", "tokens_predicted": step,
                               "tokens_evaluated": prompt}), float(step))  # fmt: skip
    meter.feed(b"data: [DONE]\n\n", 4.0)
    meter.finish()
    assert meter.first_token_at == 1.0
    assert (meter.input_tokens, meter.output_tokens) == (7, 6)


def test_sglang_samples_count_their_prompt_once() -> None:
    """SGLang's ``n``: answer ``index`` i*n+j is text i's j-th sample, each repeating
    text i's prompt count; the prompt counts once per text, every sample's output
    counts (a stream's last events, and a whole JSON array)."""
    meter = SseMeter(samples=2)
    for done in (1, 2):
        for index in range(4):  # two texts (prompts 5 and 7), two samples each
            meta = {"prompt_tokens": 5 + 2 * (index // 2), "completion_tokens": done}
            meter.feed(_event({"text": "t", "meta_info": meta, "index": index}), float(done))
    meter.finish()
    assert (meter.input_tokens, meter.output_tokens) == (5 + 7, 4 * 2)
    items = [
        b'{"text":"a","meta_info":{"prompt_tokens":%d,"completion_tokens":2}}' % prompt
        for prompt in (5, 5, 7, 7)
    ]
    body = b"[" + b",".join(items) + b"]"
    assert usage_from_body(body, samples=2) == (5 + 7, 4 * 2)
    assert usage_from_body(body) == (5 + 5 + 7 + 7, 4 * 2)  # samples of 1: each its own
    for size in (1, 5, 33):  # read as the bytes pass, cut anywhere
        counts = BatchUsage(samples=2)
        for start in range(0, len(body), size):
            counts.feed(body[start : start + size])
        assert counts.finish() == (5 + 7, 4 * 2), size


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"text": "a", "sampling_params": {"n": 3}}, 3),
        ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}]}, 2),
        ({"text": "a", "sampling_params": {"max_new_tokens": 3}}, 1),
        ({"prompt": "a", "n": 4}, 1),  # OpenAI's n: one usage for all choices
        ({"text": "a", "sampling_params": []}, 1),
        ({"text": "a", "sampling_params": {"n": True}}, 1),
        (None, 1),
    ],
)
def test_samples_per_prompt(doc: Any, expected: int) -> None:
    assert samples_per_prompt(doc) == expected


def test_meter_sums_sglang_batch_answers() -> None:
    """SGLang's ``/generate`` with a list of texts: ``meta_info`` per answer, by ``index``."""
    meter = SseMeter()
    for i in (1, 2):
        for index in (0, 1, 2):
            meta = {"prompt_tokens": 5 + index, "completion_tokens": i}
            meter.feed(_event({"text": "ab"[:i], "meta_info": meta, "index": index}), float(i))
    meter.finish()
    assert (meter.input_tokens, meter.output_tokens) == (5 + 6 + 7, 3 * 2)
