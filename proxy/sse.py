"""Reading a relayed SSE stream for time to first token and token counts.

The bytes are forwarded as they arrive; this only watches them. Events are
read line by line because a chunk boundary can fall anywhere. TTFT is the
first ``data:`` event with non-empty ``delta.content``, ``reasoning_content``,
``tool_calls``, completion ``text``, TGI ``token.text``, llama.cpp's own
``content`` or SGLang's ``text`` (both at the top of an event without
``choices`` or ``type``): not the first byte, not a role-only delta, not a ``:``
keep-alive comment (docs/REFERENCE.md).

Only events before the first token and events that carry ``usage`` are
decoded as JSON; after the first token the rest are counted by a cheap prefix
check, which keeps the relay's cost per event small. The last event is kept
and decoded once at the end (``finish``) when no ``usage`` came: that is
where TGI puts its ``details``, llama.cpp its ``timings`` and token counts,
and SGLang its ``meta_info`` (the last of counts every event repeats).
"""

from __future__ import annotations

import json
import re
from typing import Any

from proxy.batch_usage import batch_usage, is_batch

#: A line longer than this without a newline is not an SSE stream we can watch.
MAX_LINE_BYTES = 1 << 20


def has_token(event: Any) -> bool:
    """Does one decoded SSE payload carry generated content?"""
    if not isinstance(event, dict):
        return False
    token = event.get("token")
    if isinstance(token, dict) and token.get("text") and not token.get("special"):
        return True
    choices = event.get("choices")
    if choices is None:
        # llama.cpp's own API streams ``content``; SGLang's ``/generate`` the text so far.
        # A typed event is another API's (OpenAI's Responses ends its text with a
        # ``response.output_text.done`` that holds all of it): not a first token.
        if "type" in event:
            return False
        content, text = event.get("content"), event.get("text")
        return (isinstance(content, str) and content != "") or (
            isinstance(text, str) and text != ""
        )
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
        ):
            return True
    return False


class SseMeter:
    """Feeds on relayed bytes; reports the first token and the usage seen."""

    __slots__ = (
        "_buffer",
        "_last",
        "_lasts",
        "content_events",
        "done",
        "first_token_at",
        "input_tokens",
        "output_tokens",
        "samples",
    )

    def __init__(self, samples: int = 1) -> None:
        #: Answers per prompt (SGLang's ``n``): answer ``index`` i*n+j is prompt i's
        #: j-th; each repeats its prompt's count, which the sum takes once.
        self.samples = max(1, samples)
        self._buffer = b""
        self._last = b""
        #: Of a stream of running counts, the last event of each answer (``index``):
        #: a batch interleaves its prompts' answers, and each counts only its own.
        self._lasts: dict[bytes, bytes] = {}
        self.first_token_at: float | None = None
        self.content_events = 0
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.done = False

    def feed(self, chunk: bytes, now: float) -> None:
        """Watch one relayed chunk; ``now``: when it arrived, read only until the
        first token is seen (a caller may stop reading its clock from then on).

        Only ``data:`` lines are looked at; the blank line after each event
        and ``:`` comments are stepped over here, without a call. After the
        first token, a chunk that is one whole ``data:`` event without
        ``usage`` (what an engine writes per token) is counted at once.
        """
        if (
            self.first_token_at is not None
            and not self._buffer
            and chunk.startswith(b"data:")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and b'"usage"' not in chunk
        ):
            self._counted(chunk[5:-2].strip())
            return
        data = self._buffer + chunk if self._buffer else chunk
        start = 0
        find, startswith = data.find, data.startswith
        while (end := find(b"\n", start)) >= 0:
            if startswith(b"data:", start):
                self._line(data[start:end], now)
            start = end + 1
        rest = data[start:]
        self._buffer = rest if len(rest) <= MAX_LINE_BYTES else b""

    def _line(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if self.first_token_at is not None and b'"usage"' not in payload:
            self._counted(payload)
            return
        if payload == b"[DONE]":
            self.done = True  # the engine finished: only the HTTP terminator is left
            return
        if not payload:
            return
        self._last = payload
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if isinstance(event, dict) and ("tokens_predicted" in event or "meta_info" in event):
            self._indexed(payload)
        if has_token(event):
            self.content_events += 1
            if self.first_token_at is None:
                self.first_token_at = now
        self._usage(event)

    def _counted(self, payload: bytes) -> None:
        """One ``data:`` payload after the first token, without ``usage``: counted, not decoded."""
        if payload == b"[DONE]":
            self.done = True  # the engine finished: only the HTTP terminator is left
        elif payload:
            if not _finishing(payload) or _decoded_token(payload):
                self.content_events += 1
            self._last = payload
            if self._lasts:
                self._indexed(payload)

    def _indexed(self, payload: bytes) -> None:
        """Keep ``payload`` as the last event of its answer (its ``index``)."""
        match = _INDEX.search(payload)
        self._lasts[match.group(1) if match else b""] = payload

    def _usage(self, event: Any) -> None:
        if not isinstance(event, dict):
            return
        usage = event.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int):
                self.input_tokens = prompt
            if isinstance(completion, int):
                self.output_tokens = completion
        details = event.get("details")  # TGI's final event
        if isinstance(details, dict) and isinstance(details.get("generated_tokens"), int):
            self.output_tokens = details["generated_tokens"]

    def finish(self) -> None:
        """The stream ended: read the engine's own counts from its last event when no
        ``usage`` came (TGI's ``details``; SGLang's ``meta_info``; llama.cpp's
        ``tokens_predicted`` and ``tokens_evaluated``, or its ``timings``, whose
        prompt is the tokens processed plus those taken from its cache).

        SGLang and llama.cpp's own API repeat running counts in every event,
        so only the last one is read, and only here."""
        if self.output_tokens is not None or not self._last:
            return
        if len(self._lasts) > 1:
            self._sum_answers()
            return
        try:
            event = json.loads(self._last)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        self._usage(event)
        if self.output_tokens is None:
            self.input_tokens, self.output_tokens = engine_counts(event, self.input_tokens)

    def _sum_answers(self) -> None:
        """A batch's counts: the sum of each answer's last running counts."""
        prompt = completion = 0
        for index, payload in self._lasts.items():
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if isinstance(event, dict):
                given, generated = engine_counts(event, None)
                if not index or int(index) % self.samples == 0:
                    prompt += given or 0  # once per prompt, not once per sample
                completion += generated or 0
        self.input_tokens = prompt or self.input_tokens
        self.output_tokens = completion


_INDEX = re.compile(rb'"index"\s*:\s*(\d+)')


def _finishing(payload: bytes) -> bool:
    """An event that names its answer's ``finish_reason`` (OpenAI's, vLLM's, the
    simulator's last chunk): often an empty delta, not a token. A cheap test
    first: every other event says ``"finish_reason": null`` or nothing."""
    return b'"finish_reason":"' in payload or b'"finish_reason": "' in payload


def _decoded_token(payload: bytes) -> bool:
    """Whether a finishing event carries a token too (vLLM may send the last one
    with the reason): decoded, once per answer."""
    try:
        return has_token(json.loads(payload))
    except ValueError:
        return True  # not JSON: counted as before


def engine_counts(event: dict[str, Any], prompt: int | None) -> tuple[int | None, int | None]:
    """Prompt and completion tokens of an engine's own final event (``prompt`` when
    it names none): SGLang's ``meta_info``, llama.cpp's counts or ``timings``."""
    meta = event.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("completion_tokens"), int):
        given = meta.get("prompt_tokens")
        return (given if isinstance(given, int) else prompt), meta["completion_tokens"]
    predicted, evaluated = event.get("tokens_predicted"), event.get("tokens_evaluated")
    if isinstance(predicted, int):
        return (evaluated if isinstance(evaluated, int) else prompt), predicted
    timings = event.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        processed, cached = timings.get("prompt_n"), timings.get("cache_n")
        if isinstance(processed, int):
            prompt = processed + (cached if isinstance(cached, int) else 0)
        return prompt, timings["predicted_n"]
    return prompt, None


_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_EVALUATED = re.compile(rb'"tokens_evaluated"\s*:\s*(\d+)')
_PREDICTED = re.compile(rb'"tokens_predicted"\s*:\s*(\d+)')


def usage_from_body(body: bytes, samples: int = 1) -> tuple[int | None, int | None]:
    """Token counts from a non-streaming answer: OpenAI's ``usage``, SGLang's
    ``meta_info`` (the same two names) or llama.cpp's own ``tokens_evaluated``
    and ``tokens_predicted``, when it has them.

    A scan for the fields instead of decoding the whole JSON document: the
    relay does this for every answer, and only these numbers matter. A name
    in quotes cannot come from a string value, where quotes are escaped. A
    batch answer (a JSON array, one answer per prompt) counts all its answers,
    each prompt once however many ``samples`` it was asked for.
    """
    if is_batch(body):
        return batch_usage(body, samples)
    if b'"usage"' in body or b'"meta_info"' in body:
        prompt, completion = _PROMPT_TOKENS.search(body), _COMPLETION_TOKENS.search(body)
    elif b'"tokens_predicted"' in body:
        prompt, completion = _EVALUATED.search(body), _PREDICTED.search(body)
    else:
        return None, None
    return (
        int(prompt.group(1)) if prompt else None,
        int(completion.group(1)) if completion else None,
    )
