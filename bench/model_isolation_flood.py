"""Model A's flood for the model isolation benchmark, in a process of its own.

The flood runs apart from the process that times model B, so B's timings do
not wait behind the flood's own event loop (with one process, every one of
A's streamed chunks was read on the loop that also stamps B's first token),
and so its CPU can be counted, pinned or reniced on its own.

``--clients`` closed-loop clients send streamed chats for ``model-a`` to
``--url`` (the proxy, or A's engine directly) until the process gets SIGTERM
or SIGINT; then it prints one JSON line, ``{"answers": N, "failed": M}``.

    python -m bench.model_isolation_flood --url http://127.0.0.1:PORT --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys

import aiohttp
import uvloop

from bench.load import load_session
from bench.prefix_affinity import API_KEY
from proxy.loadtest.client import request_resending_stale

MODEL = "model-a"
PATH = "/v1/chat/completions"
REQUEST_DEADLINE_S = 60.0
#: Chunks read per ``iter_chunked`` call; a streamed answer arrives as many small chunks.
CHUNK = 65536


def body(max_tokens: int, stream: bool) -> bytes:
    document = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a story " * 8}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    return json.dumps(document).encode()


async def flood(url: str, clients: int, max_tokens: int, stream: bool) -> dict[str, int]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    payload = body(max_tokens, stream)
    counts = {"answers": 0, "failed": 0}

    async def client(index: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            headers = {
                "Authorization": f"Bearer {API_KEY}",
                "Content-Type": "application/json",
                "X-Request-Id": f"flood-{index}-{n}",
            }
            ok = False
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                async with asyncio.timeout(REQUEST_DEADLINE_S):
                    response = await request_resending_stale(
                        session, "POST", url + PATH, payload, headers
                    )
                    async with response:
                        async for _ in response.content.iter_chunked(CHUNK):
                            pass
                        ok = response.status == 200
            counts["answers" if ok else "failed"] += 1

    async with load_session(clients + 4, connect_s=5.0) as session:
        workers = [asyncio.create_task(client(i)) for i in range(clients)]
        await stop.wait()
        for worker in workers:  # an answer still in flight is cut and not counted
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the proxy, or model A's engine")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-stream", action="store_true", help="ask for whole answers")
    args = parser.parse_args()
    counts = uvloop.run(flood(args.url, args.clients, args.max_tokens, not args.no_stream))
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
