"""``sse.SseMeter`` counts the same however a stream is cut into chunks.

The meter has a shortcut for the usual chunk after the first token (one whole
``data:`` event without ``usage``) beside its line-by-line reading: both must
give the same first token, counts, end and usage for any split of the bytes.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from proxy.sse import SseMeter


def _event(doc: dict[str, Any], end: bytes = b"\n\n") -> bytes:
    return b"data: " + json.dumps(doc).encode() + end


def _content(text: str) -> dict[str, Any]:
    return {"choices": [{"delta": {"content": text}}]}


#: An OpenAI stream with include_usage: a role delta, a comment, content (one event
#: CRLF-framed, one empty data line between), the usage event, [DONE].
WITH_USAGE = [
    _event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
    b": keep-alive\n\n",
    *(_event(_content(f"t{i}")) for i in range(6)),
    _event(_content("crlf"), b"\r\n\r\n"),
    b"data:\n\n",
    *(_event(_content(f"u{i}")) for i in range(3)),
    _event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 10}}),
    b"data: [DONE]\n\n",
]
#: llama-server without include_usage: its last event's timings give the counts.
WITH_TIMINGS = [
    _event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
    *(_event(_content(f"t{i}")) for i in range(5)),
    _event({"choices": [{"delta": {}}], "timings": {"prompt_n": 3, "predicted_n": 5}}),
    b"data: [DONE]\n\n",
]

#: llama.cpp's own ``/completion`` with two prompts: a ``null`` event, then both
#: answers interleaved, each event with its ``index`` and that answer's running counts.
BATCH = [
    b"data: null\n\n",
    *(
        _event({"index": i, "content": "t", "tokens_predicted": step, "tokens_evaluated": 3 + i})
        for step in (1, 2, 3)
        for i in (1, 0)
    ),
    *(
        _event(
            {
                "index": i,
                "content": "",
                "stop": True,
                "tokens_predicted": 3,
                "tokens_evaluated": 3 + i,
                "timings": {"predicted_n": 3},
            }
        )
        for i in (0, 1)
    ),
    b"data: [DONE]\n\n",
]


def _metered(chunks: list[bytes]) -> tuple[object, ...]:
    """What the meter says after ``chunks``, and whether ``done`` came only once the
    ``[DONE]`` line had been fed whole."""
    stream = b"".join(chunks)
    done_line_end = stream.index(b"data: [DONE]") + len(b"data: [DONE]\n")
    meter = SseMeter()
    fed, done_at = 0, None
    for chunk in chunks:
        meter.feed(chunk, 1.0)
        fed += len(chunk)
        if meter.done and done_at is None:
            done_at = fed
    meter.finish()
    return (
        meter.first_token_at,
        meter.content_events,
        meter.input_tokens,
        meter.output_tokens,
        done_at is not None and done_at >= done_line_end,
    )


def _splits(stream: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(stream)), 12))
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        (WITH_USAGE, (1.0, 10, 7, 10, True)),
        (WITH_TIMINGS, (1.0, 6, 3, 5, True)),
        (BATCH, (1.0, 8, 3 + 4, 2 * 3, True)),
    ],
    ids=["usage", "timings", "batch"],
)
def test_every_split_of_a_stream_meters_the_same(
    events: list[bytes], expected: tuple[object, ...]
) -> None:
    """Event by event (the shortcut), all at once, byte by byte and at random cuts:
    the same first token, content events, usage and end."""
    stream = b"".join(events)
    assert _metered(events) == expected
    assert _metered([stream]) == expected
    assert _metered([stream[i : i + 1] for i in range(len(stream))]) == expected
    for seed in range(20):
        assert _metered(_splits(stream, seed)) == expected


def test_a_responses_stream_has_no_first_token_at_its_end() -> None:
    """OpenAI's Responses API (llama-server, vLLM and SGLang serve ``/v1/responses``):
    its deltas are not read as tokens, and its closing ``response.output_text.done``,
    which holds the whole text at the top of the event, is no first token either
    (its time is the whole answer's, not the time to first token)."""
    events = [
        _event({"type": "response.created", "response": {"status": "in_progress"}}),
        _event({"type": "response.output_text.delta", "item_id": "m", "delta": "Hi"}),
        _event({"type": "response.output_text.done", "item_id": "m", "text": "Hi there"}),
        _event({"type": "response.completed", "response": {"status": "completed"}}),
    ]
    meter = SseMeter()
    for at, event in enumerate(events):
        meter.feed(event, float(at))
    meter.finish()
    assert (meter.first_token_at, meter.content_events) == (None, 0)
