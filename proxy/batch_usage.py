"""Token counts of a batch answer: a JSON array with one answer per prompt.

llama.cpp's ``/completion`` given a list of prompts, and SGLang's
``/generate`` given a list of texts (or ``n`` above 1), answer with a JSON
array whose every item carries its own counts (llama.cpp's
``tokens_evaluated`` and ``tokens_predicted``, SGLang's ``meta_info``
``prompt_tokens`` and ``completion_tokens``). The request used their sum;
reading the first item alone charged a batch of a hundred prompts as one.

Such an answer can be far longer than what the relay keeps of a body, so
the counts are summed as the bytes pass (``feed``), a few bytes carried
across chunk boundaries so that a name cut in two is read once. A name in
quotes cannot come from a string value, where quotes are escaped.

    counts = BatchUsage()
    for chunk in chunks:
        counts.feed(chunk)
    prompt, completion = counts.finish()
"""

from __future__ import annotations

import re

#: One count and its value; whitespace bounded so a match fits in ``CARRY``.
_COUNT = re.compile(
    rb'"(prompt_tokens|completion_tokens|tokens_evaluated|tokens_predicted)"\s{0,16}:\s{0,16}(\d{1,18})'
)
#: Bytes kept from one chunk to the next: longer than any match of ``_COUNT``.
CARRY = 128


def is_batch(first_chunk: bytes) -> bool:
    """Does an answer that starts with these bytes look like a JSON array?"""
    return first_chunk.lstrip()[:1] == b"["


class BatchUsage:
    """Sums every item's counts of a JSON array answer, fed chunk by chunk.

    ``samples``: answers per prompt (SGLang's ``n``). SGLang lists the ``n``
    answers of each prompt one after another, each repeating its prompt's
    ``prompt_tokens``; the prompt is prefilled once and shared, and SGLang's
    own OpenAI usage counts it once, so only the first of each ``samples``
    prompt counts is added (a prompt of 1,000 tokens asked with ``n: 8``
    was charged 8,000).
    """

    __slots__ = ("_carry", "_prompts_seen", "_samples", "_sums")

    def __init__(self, samples: int = 1) -> None:
        self._carry = b""
        self._samples = max(1, samples)
        self._prompts_seen = 0
        self._sums: dict[bytes, int] = {}

    def __repr__(self) -> str:
        return f"<BatchUsage {self._sums!r}>"

    def feed(self, chunk: bytes) -> None:
        """Count the matches that end in ``chunk``, except one that touches its end
        (its digits may go on in the next chunk: it is counted then, or by ``finish``)."""
        data = self._carry + chunk
        boundary, end = len(self._carry), len(data)
        for match in _COUNT.finditer(data):
            if boundary <= match.end() < end:
                self._add(match)
        self._carry = data[-CARRY:]

    def finish(self) -> tuple[int | None, int | None]:
        """Prompt and completion tokens of the whole answer (None where none was named)."""
        for match in _COUNT.finditer(self._carry):
            if match.end() == len(self._carry):
                self._add(match)
        sums = self._sums
        prompt = sums.get(b"prompt_tokens", sums.get(b"tokens_evaluated"))
        completion = sums.get(b"completion_tokens", sums.get(b"tokens_predicted"))
        return prompt, completion

    def _add(self, match: re.Match[bytes]) -> None:
        name = match.group(1)
        if name == b"prompt_tokens":
            self._prompts_seen += 1
            if (self._prompts_seen - 1) % self._samples:
                return  # another answer to a prompt already counted
        self._sums[name] = self._sums.get(name, 0) + int(match.group(2))


def batch_usage(body: bytes, samples: int = 1) -> tuple[int | None, int | None]:
    """The summed counts of a whole batch answer (``samples``: answers per prompt)."""
    counts = BatchUsage(samples)
    counts.feed(body)
    return counts.finish()
