"""Streamed token counts without ``usage``: the content events, not the closing one."""

from __future__ import annotations

import json
from typing import Any

from proxy.sse import SseMeter


def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


def metered(*events: bytes) -> SseMeter:
    meter = SseMeter()
    for i, chunk in enumerate(events):
        meter.feed(chunk, float(i))
    meter.feed(b"data: [DONE]\n\n", 99.0)
    meter.finish()
    return meter


def test_the_closing_empty_delta_is_no_token() -> None:
    """OpenAI's and vLLM's last chunk names the finish reason with an empty delta: five
    tokens are five, not six (the access line, admission_tokens_total, the quota)."""
    tokens = [event({"content": f" t{i}"}) for i in range(5)]
    meter = metered(event({"role": "assistant", "content": ""}), *tokens, event({}, "length"))
    assert meter.content_events == 5


def test_a_last_token_sent_with_its_finish_reason_counts() -> None:
    """An engine that sends the last token and the reason together: that one counts."""
    tokens = [event({"content": f" t{i}"}) for i in range(4)]
    meter = metered(*tokens, event({"content": " end"}, "stop"))
    assert meter.content_events == 5
