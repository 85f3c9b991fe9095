"""Streaming overhead benchmark: the proxy's CPU per relayed SSE token, against the pass-through.

A relayed stream costs the proxy per token, not per request: every event
the engine writes is read, watched (``proxy.sse.SseMeter``) and written on.
When one model's pool is flooded, that per-token CPU is what the proxy's
event loop spends on the flood while another model's first token waits
(``bench.model_isolation``). This measures it alone, without engines.

``bench.fast_upstream`` streams ``--tokens`` one-token events per request,
``TOKEN_INTERVAL_S`` apart (an engine's pace: each event reaches the front
in a chunk of its own). ``--streams`` closed-loop clients read those
streams through each target of ``bench.overhead``'s servers:

- ``passthrough``: ``bench.passthrough``, which relays an SSE answer chunk by
  chunk and does nothing else: the in-run baseline;
- ``proxy``: ``admission-proxy serve`` as it ships (metrics and access log
  on, tracing off).

The figure is the front process's CPU (``/proc/<pid>/stat``, all threads)
over the content tokens the clients received, in µs per token, and its
ratio to the pass-through's in the same round (the median over rounds,
whose target order rotates). The proxy's per-request cost (admission,
access log) is included, spread over the request's tokens. The clients'
reads per token show whether events arrived one per chunk (1.0) or
coalesced (below 1: the front was too busy to keep up, which makes the
per-token figure look cheaper than it is).

    .venv/bin/python -m bench.stream_overhead [--streams 4] [--tokens 64]
        [--requests 160] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from bench.common import cpu_line, machine, own_cpu, revision, summarize_rounds, write_results
from bench.fast_upstream import TOKEN_EVENT, TOKEN_INTERVAL_S
from bench.load import Requester, closed_loop, load_session
from bench.overhead import HEADERS, PATH, READY_TIMEOUT_S, servers
from bench.processes import Server, wait_ready
from proxy.settings import ConfigError

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "stream_overhead.json"
TARGETS = ("passthrough", "proxy")
#: Few enough streams that the proxy keeps up with ``TOKEN_INTERVAL_S`` on a
#: loaded 2-CPU machine (else events coalesce and the figure flatters it).
DEFAULT_STREAMS = 4
#: ``bench.model_isolation``'s flood asks for 64 tokens per answer.
DEFAULT_TOKENS = 64
#: 160 x 64 tokens: about 2 s of the proxy's CPU per run, 200 clock ticks.
DEFAULT_REQUESTS = 160
DEFAULT_ROUNDS = 3
RUN_CAP_S = 60.0
REQUEST_TIMEOUT_S = 30.0
DONE_EVENT = b"data: [DONE]\n\n"


def stream_body(tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "bench-model",
            "messages": [{"role": "user", "content": "Say ok."}],
            "max_tokens": tokens,
            "stream": True,
        }
    ).encode()


class StreamRequester(Requester):
    """One streamed request, read chunk by chunk; its tokens and reads counted.

    A stream counts as answered when it ends with ``[DONE]`` after exactly
    the tokens asked for; anything else is an error of kind "short stream".
    """

    __slots__ = ("_expected", "reads", "tokens")

    def __init__(
        self, session: aiohttp.ClientSession, url: str, tokens: int, headers: dict[str, str]
    ) -> None:
        super().__init__(session, url, stream_body(tokens), headers)
        self._expected = tokens
        self.tokens = 0
        self.reads = 0

    async def send(self) -> None:
        sent = time.perf_counter()
        body = bytearray()
        reads = 0
        try:
            async with self._session.post(
                self._url, data=self._body, headers=self._headers
            ) as response:
                async for chunk in response.content.iter_any():
                    reads += 1
                    body += chunk
                error = None if response.status == 200 else f"status {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = type(exc).__name__
        tokens = body.count(TOKEN_EVENT)
        if error is None and (tokens != self._expected or not body.endswith(DONE_EVENT)):
            error = "short stream"
        if error is None:
            self.latencies.append(time.perf_counter() - sent)
            self.tokens += tokens
            self.reads += reads
        else:
            self.error_kinds[error] = self.error_kinds.get(error, 0) + 1


@dataclass(slots=True)
class Run:
    """One measured run of one target."""

    target: str
    round: int
    streams: int
    errors: dict[str, int]
    tokens: int
    elapsed_s: float
    tokens_per_s: float
    #: The clients' reads per token received (1.0: one event per chunk).
    reads_per_token: float
    front_cpu_s: float
    front_us_per_token: float
    upstream_us_per_token: float
    loadgen_us_per_token: float


async def measure(
    target: str, round_no: int, running: dict[str, Server], args: argparse.Namespace
) -> Run:
    """A short warm-up, then ``args.requests`` streams with ``args.streams`` clients."""
    front, upstream = running[target], running["direct"]
    async with load_session(args.streams, total_s=REQUEST_TIMEOUT_S) as session:
        url = front.url + PATH
        warm = StreamRequester(session, url, args.tokens, HEADERS)
        await closed_loop(warm, 2 * args.streams, args.streams, RUN_CAP_S)
        requester = StreamRequester(session, url, args.tokens, HEADERS)
        before = (front.cpu(), upstream.cpu(), own_cpu())
        sample = await closed_loop(requester, args.requests, args.streams, RUN_CAP_S)
        after = (front.cpu(), upstream.cpu(), own_cpu())
    tokens = max(1, requester.tokens)
    cpu = [(b - a) for a, b in zip(before, after, strict=True)]
    return Run(
        target=target,
        round=round_no,
        streams=sample.ok,
        errors=sample.error_kinds,
        tokens=requester.tokens,
        elapsed_s=round(sample.elapsed_s, 3),
        tokens_per_s=requester.tokens / sample.elapsed_s if sample.elapsed_s > 0 else 0.0,
        reads_per_token=requester.reads / tokens,
        front_cpu_s=round(cpu[0], 3),
        front_us_per_token=cpu[0] * 1e6 / tokens,
        upstream_us_per_token=cpu[1] * 1e6 / tokens,
        loadgen_us_per_token=cpu[2] * 1e6 / tokens,
    )


async def bench(args: argparse.Namespace, running: dict[str, Server]) -> list[Run]:
    async with aiohttp.ClientSession() as probe:
        for server in running.values():
            await wait_ready(probe, server, READY_TIMEOUT_S)
    runs: list[Run] = []
    for round_no in range(args.rounds):
        shift = round_no % len(TARGETS)
        for target in TARGETS[shift:] + TARGETS[:shift]:
            run = await measure(target, round_no, running, args)
            runs.append(run)
            print(
                f"  round {round_no} {target:<12} {run.tokens_per_s:6.0f} tokens/s"
                f"  cpu {run.front_us_per_token:6.1f} µs/token ({run.front_cpu_s:.2f} s)"
                f"  reads/token {run.reads_per_token:.2f}  errors {run.errors or 0}",
                flush=True,
            )
    return runs


FIELDS = (
    "tokens_per_s", "reads_per_token", "front_us_per_token", "upstream_us_per_token",
    "loadgen_us_per_token",
)  # fmt: skip


def summarize(runs: Sequence[Run]) -> dict[str, Any]:
    """Medians over rounds per target, and the median of per-round ratios to the pass-through."""
    return summarize_rounds(runs, TARGETS, FIELDS, _round_ratios)


def _round_ratios(rr: dict[str, Run]) -> dict[str, float]:
    """One round's figures: the proxy's CPU per token against the pass-through's."""
    proxy, passthrough = rr["proxy"].front_us_per_token, rr["passthrough"].front_us_per_token
    return {"cpu_ratio": proxy / passthrough, "added_us_per_token": proxy - passthrough}


def report(args: argparse.Namespace, summary: dict[str, Any]) -> str:
    lines = [
        f"{args.streams} concurrent streams of {args.tokens} tokens, one every "
        f"{TOKEN_INTERVAL_S * 1000:.0f} ms ({args.requests} streams per run, "
        f"median of {args.rounds} rounds):",
        "",
        "| target | tokens/s | client reads per token | CPU µs/token (front) "
        "| CPU µs/token (upstream) | CPU µs/token (load gen) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in TARGETS:
        row = summary["targets"][name]
        lines.append(
            f"| {name} | {row['tokens_per_s']:.0f} | {row['reads_per_token']:.2f} "
            f"| {row['front_us_per_token']:.1f} | {row['upstream_us_per_token']:.1f} "
            f"| {row['loadgen_us_per_token']:.1f} |"
        )
    r = summary["ratios"]
    lines += [
        "",
        f"proxy against the pass-through (median of per-round figures): CPU per token "
        f"{r['cpu_ratio']:.2f}x ({r['added_us_per_token']:+.1f} µs per token)",
    ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.stream_overhead", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("--streams", type=int, default=DEFAULT_STREAMS, help="concurrent streams (clients)")
    add("--tokens", type=int, default=DEFAULT_TOKENS, help="content tokens per stream")
    add("--requests", type=int, default=DEFAULT_REQUESTS, help="measured streams per run")
    add("--rounds", type=int, default=DEFAULT_ROUNDS, help="rounds; target order rotates")
    add("--output", type=Path, default=RESULTS, help="JSON results file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    print(
        f"stream_overhead: {args.rounds} rounds x {len(TARGETS)} targets; {args.requests} "
        f"streams of {args.tokens} tokens per run, {args.streams} at once; "
        f"{os.cpu_count()} CPUs shared by the load generator and the servers"
    )
    print(cpu_line(), flush=True)
    started = time.monotonic()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp,
            servers(Path(tmp), {}) as running,
        ):
            runs = uvloop.run(bench(args, running))
            crashed = [s.name for s in running.values() if s.process.poll() is not None]
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, ConfigError) as exc:
        print(f"stream_overhead: {exc}", file=sys.stderr)
        return 1
    if crashed:
        print(f"stream_overhead: servers exited during the run: {crashed}", file=sys.stderr)
        return 1
    summary = summarize(runs)
    print()
    print(report(args, summary))
    write_results(
        args.output,
        {
            "benchmark": "stream_overhead",
            "command": "python -m bench.stream_overhead "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "parameters": {
                "streams": args.streams,
                "tokens": args.tokens,
                "requests": args.requests,
                "rounds": args.rounds,
                "token_interval_s": TOKEN_INTERVAL_S,
            },
            "revision": revision(),
            "machine": machine("load generator, proxy and upstream share the same CPUs"),
            "wall_s": round(time.monotonic() - started, 1),
            "summary": summary,
            "runs": [asdict(r) for r in runs],
        },
    )
    print(f"\nresults: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
