"""Wire formats of the simulated replica: OpenAI chat, OpenAI completions, TGI.

Owns request parsing (prompt-token estimate, output length, stream flags) and
rendering of response bodies and SSE events. No I/O and no engine access: a
handler parses with a `Dialect`, then asks the `Renderer` it returns for bytes.

Stream events are built from precomputed byte templates, so a token costs one
`json.dumps` of a short string, not of a whole chunk object.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from proxy.sim.sequence import VOCABULARY

__all__ = [
    "DIALECTS",
    "BadRequest",
    "ChatDialect",
    "CompletionDialect",
    "Dialect",
    "GenerationRequest",
    "Renderer",
    "TgiDialect",
    "Usage",
    "error_body",
    "estimate_tokens",
]

CHARS_PER_TOKEN = 4
DONE_EVENT = b"data: [DONE]\n\n"
_TOKEN_JSON: tuple[str, ...] = tuple(json.dumps(text) for text in VOCABULARY)


class BadRequest(Exception):
    """The request body is not one the engine API accepts (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def error_body(message: str, error_type: str, code: int | str) -> dict[str, object]:
    """OpenAI-style error object, used by every route of the sim."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def estimate_tokens(text: str) -> int:
    """Prompt length without a tokenizer: about four characters a token, at least one."""
    return max(1, len(text) // CHARS_PER_TOKEN)


class Renderer(Protocol):
    """Bytes for one request's response, in its dialect."""

    def opening_events(self) -> list[bytes]: ...

    def token_event(self, token_id: int) -> bytes: ...

    def closing_events(self, usage: Usage) -> list[bytes]: ...

    def full_body(self, token_ids: list[int], usage: Usage) -> dict[str, object]: ...


class Dialect(Protocol):
    name: str

    def parse(self, body: object, default_max_tokens: int) -> GenerationRequest: ...

    def renderer(self, request: GenerationRequest, request_id: int, model: str) -> Renderer: ...


def _object(body: object) -> Mapping[str, object]:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _positive_int(body: Mapping[str, object], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{name} must be a positive integer, got {value!r}")
    return value


def _openai_common(
    body: Mapping[str, object], prompt_tokens: int, default_max_tokens: int
) -> GenerationRequest:
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be a boolean, got {stream!r}")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object")
        include_usage = options.get("include_usage", False) is True
    return GenerationRequest(
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens or default_max_tokens,
        stream=stream,
        include_usage=include_usage,
    )


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


class _OpenAIRenderer:
    """Shared chunk layout of chat and completion streams.

    `_choice_head`/`_choice_tail` wrap the per-token JSON string: the only part
    of a chunk that changes from token to token.
    """

    __slots__ = ("_chunk_head", "_completion_id", "_created", "_model", "_request")

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""
    token_key = ""

    def __init__(self, request: GenerationRequest, request_id: int, model: str) -> None:
        self._request = request
        self._completion_id = f"{self.id_prefix}-sim{request_id:08d}"
        self._created = int(time.time())
        self._model = model
        self._chunk_head = (
            f'data: {{"id":"{self._completion_id}","object":"{self.chunk_object_name}",'
            f'"created":{self._created},"model":{json.dumps(model)},"choices":'
        ).encode()

    def _chunk(self, choices_json: str) -> bytes:
        return self._chunk_head + choices_json.encode() + b"}\n\n"

    def _envelope(self, object_name: str) -> dict[str, object]:
        return {
            "id": self._completion_id,
            "object": object_name,
            "created": self._created,
            "model": self._model,
        }

    def closing_events(self, usage: Usage) -> list[bytes]:
        events = [self._chunk(self._finish_choice())]
        if self._request.include_usage:
            chunk = self._envelope(self.chunk_object_name)
            chunk["choices"] = []
            chunk["usage"] = usage.to_json()
            events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        events.append(DONE_EVENT)
        return events

    def _finish_choice(self) -> str:
        raise NotImplementedError


class _ChatRenderer(_OpenAIRenderer):
    __slots__ = ()
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def opening_events(self) -> list[bytes]:
        # Role-only delta first, as vLLM sends it: not a token, not the TTFT.
        return [
            self._chunk(
                '[{"index":0,"delta":{"role":"assistant","content":""},'
                '"logprobs":null,"finish_reason":null}]'
            )
        ]

    def token_event(self, token_id: int) -> bytes:
        return self._chunk(
            '[{"index":0,"delta":{"content":'
            + _TOKEN_JSON[token_id]
            + '},"logprobs":null,"finish_reason":null}]'
        )

    def _finish_choice(self) -> str:
        return '[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]'

    def full_body(self, token_ids: list[int], usage: Usage) -> dict[str, object]:
        body = self._envelope(self.object_name)
        body["choices"] = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": _join(token_ids)},
                "logprobs": None,
                "finish_reason": "length",
            }
        ]
        body["usage"] = usage.to_json()
        return body


class _CompletionRenderer(_OpenAIRenderer):
    __slots__ = ()
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def opening_events(self) -> list[bytes]:
        return []

    def token_event(self, token_id: int) -> bytes:
        return self._chunk(
            '[{"index":0,"text":'
            + _TOKEN_JSON[token_id]
            + ',"logprobs":null,"finish_reason":null}]'
        )

    def _finish_choice(self) -> str:
        return '[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]'

    def full_body(self, token_ids: list[int], usage: Usage) -> dict[str, object]:
        body = self._envelope(self.object_name)
        body["choices"] = [
            {"index": 0, "text": _join(token_ids), "logprobs": None, "finish_reason": "length"}
        ]
        body["usage"] = usage.to_json()
        return body


class _TgiRenderer:
    """TGI `generate_stream` events: the last token event carries `generated_text`."""

    __slots__ = ("_request", "_texts")

    def __init__(self, request: GenerationRequest, request_id: int, model: str) -> None:
        self._request = request
        self._texts: list[str] = []

    def opening_events(self) -> list[bytes]:
        return []

    def token_event(self, token_id: int) -> bytes:
        text = VOCABULARY[token_id]
        self._texts.append(text)
        index = len(self._texts)
        token = f'{{"id":{token_id},"text":{_TOKEN_JSON[token_id]},"logprob":0.0,"special":false}}'
        if index < self._request.max_tokens:
            tail = '"generated_text":null,"details":null'
        else:
            details = {"finish_reason": "length", "generated_tokens": index, "seed": None}
            tail = (
                f'"generated_text":{json.dumps("".join(self._texts))},'
                f'"details":{json.dumps(details)}'
            )
        return f'data: {{"index":{index},"token":{token},{tail}}}\n\n'.encode()

    def closing_events(self, usage: Usage) -> list[bytes]:
        return []

    def full_body(self, token_ids: list[int], usage: Usage) -> dict[str, object]:
        return {"generated_text": _join(token_ids)}


def _join(token_ids: list[int]) -> str:
    return "".join(VOCABULARY[token_id] for token_id in token_ids)


class ChatDialect:
    name = "chat"

    def parse(self, body: object, default_max_tokens: int) -> GenerationRequest:
        fields = _object(body)
        messages = fields.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        texts = []
        for message in messages:
            if not isinstance(message, dict):
                raise BadRequest("each message must be an object")
            texts.append(_content_text(message.get("content")))
        return _openai_common(fields, estimate_tokens("\n".join(texts)), default_max_tokens)

    def renderer(self, request: GenerationRequest, request_id: int, model: str) -> Renderer:
        return _ChatRenderer(request, request_id, model)


class CompletionDialect:
    name = "completion"

    def parse(self, body: object, default_max_tokens: int) -> GenerationRequest:
        fields = _object(body)
        prompt = fields.get("prompt")
        if isinstance(prompt, str):
            prompt_tokens = estimate_tokens(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompt_tokens = estimate_tokens("".join(str(p) for p in prompt))
        elif isinstance(prompt, list) and prompt and all(type(p) is int for p in prompt):
            prompt_tokens = len(prompt)  # already token ids
        else:
            raise BadRequest("prompt must be a string, a list of strings or a list of token ids")
        return _openai_common(fields, prompt_tokens, default_max_tokens)

    def renderer(self, request: GenerationRequest, request_id: int, model: str) -> Renderer:
        return _CompletionRenderer(request, request_id, model)


class TgiDialect:
    """TGI `/generate` and `/generate_stream`; the route, not the body, says stream."""

    name = "tgi"

    def __init__(self, *, stream: bool) -> None:
        self._stream = stream

    def parse(self, body: object, default_max_tokens: int) -> GenerationRequest:
        fields = _object(body)
        inputs = fields.get("inputs")
        if not isinstance(inputs, str):
            raise BadRequest("inputs must be a string")
        parameters = fields.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise BadRequest("parameters must be an object")
        max_new_tokens = _positive_int(parameters, "max_new_tokens")
        return GenerationRequest(
            prompt_tokens=estimate_tokens(inputs),
            max_tokens=max_new_tokens or default_max_tokens,
            stream=self._stream,
            include_usage=False,
        )

    def renderer(self, request: GenerationRequest, request_id: int, model: str) -> Renderer:
        return _TgiRenderer(request, request_id, model)


DIALECTS: dict[str, Dialect] = {
    "/v1/chat/completions": ChatDialect(),
    "/v1/completions": CompletionDialect(),
    "/generate": TgiDialect(stream=False),
    "/generate_stream": TgiDialect(stream=True),
}
