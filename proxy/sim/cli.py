"""The `sim` subcommand: flags, and serving until SIGINT or SIGTERM.

Owns the mapping from flags to `SimConfig`. The top-level CLI adds these
flags to its own subparser (`add_sim_arguments`) and calls `run_sim`; nothing
here parses `sys.argv` or exits the process.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable

from proxy.sim import config as defaults
from proxy.sim.config import SimConfig
from proxy.sim.faults import DEFAULT_ERROR_STATUS, Faults, FaultsError
from proxy.sim.runner import SimServer, start_sim

__all__ = ["SimServer", "add_sim_arguments", "config_from_args", "run_sim", "start_sim"]

DEFAULT_HOST = "127.0.0.1"


#: Flag, type, default and help of each engine-model flag (``SimConfig``'s fields).
_ENGINE_FLAGS: tuple[tuple[str, type, object, str], ...] = (
    ("--slots", int, defaults.DEFAULT_SLOTS, "sequences running at once (default %(default)s)"),
    ("--max-waiting", int, None, "waiting-queue bound; over it, 503 at once (default: unbounded)"),
    ("--kv-cache-tokens", int, defaults.DEFAULT_KV_CACHE_TOKENS,
     "KV-cache capacity in tokens (default %(default)s)"),
    ("--prefill-ms-per-token", float, defaults.DEFAULT_PREFILL_MS_PER_TOKEN,
     "prefill cost per prompt token (default %(default)s)"),
    ("--decode-base-ms", float, defaults.DEFAULT_DECODE_BASE_MS,
     "decode step time for an empty batch (default %(default)s)"),
    ("--decode-per-seq-ms", float, defaults.DEFAULT_DECODE_PER_SEQ_MS,
     "extra step time per running sequence (default %(default)s)"),
    ("--default-max-tokens", int, defaults.DEFAULT_MAX_TOKENS,
     "output length when a request sets none (default %(default)s)"),
    ("--seed", int, defaults.DEFAULT_SEED,
     "seed for generated text and fault decisions (default %(default)s)"),
    ("--model-name", str, defaults.DEFAULT_MODEL_NAME, "model id served (default %(default)s)"),
)  # fmt: skip
#: The same for the fault flags (``Faults``' fields).
_FAULT_FLAGS: tuple[tuple[str, type, object, str], ...] = (
    ("--error-rate", float, 0.0, "fraction of requests answered with --error-status"),
    ("--error-status", int, DEFAULT_ERROR_STATUS,
     "status of injected errors (default %(default)s)"),
    ("--error-retry-after-s", float, None, "Retry-After sent with injected errors"),
    ("--hang-ms", float, 0.0, "hang before the first response byte (-1: forever)"),
    ("--reset-after-tokens", int, None, "abort a stream's TCP connection after N tokens"),
    ("--slow-accept-ms", float, 0.0, "delay before reading each request"),
    ("--refuse-connections-ms", float, 0.0,
     "refuse connections this long after start (-1: until changed)"),
)  # fmt: skip


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help="address to bind (default %(default)s)"
    )
    parser.add_argument("--port", type=int, required=True, help="port to bind (0: the OS picks)")
    engine = parser.add_argument_group("engine model")
    for flag, kind, default, text in _ENGINE_FLAGS:
        engine.add_argument(flag, type=kind, default=default, help=text)
    faults = parser.add_argument_group("fault injection (also at runtime: POST /sim/faults)")
    for flag, kind, default, text in _FAULT_FLAGS:
        faults.add_argument(flag, type=kind, default=default, help=text)


def config_from_args(ns: argparse.Namespace) -> SimConfig:
    """Build the config from parsed flags; raises ValueError naming the bad value."""
    faults = Faults(
        error_rate=ns.error_rate,
        error_status=ns.error_status,
        error_retry_after_s=ns.error_retry_after_s,
        hang_before_first_byte_ms=ns.hang_ms,
        reset_mid_stream_after_tokens=ns.reset_after_tokens,
        slow_accept_ms=ns.slow_accept_ms,
        refuse_connections_ms=ns.refuse_connections_ms,
    )
    return SimConfig(
        slots=ns.slots,
        max_waiting=ns.max_waiting,
        kv_cache_tokens=ns.kv_cache_tokens,
        prefill_ms_per_token=ns.prefill_ms_per_token,
        decode_base_ms=ns.decode_base_ms,
        decode_per_seq_ms=ns.decode_per_seq_ms,
        default_max_tokens=ns.default_max_tokens,
        seed=ns.seed,
        model_name=ns.model_name,
        faults=faults,
    )


def run_sim(ns: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; 0 on a clean stop, 2 on bad flags, 1 if binding fails."""
    try:
        config = config_from_args(ns)
    except (ValueError, FaultsError) as exc:
        print(f"sim: invalid setting: {exc}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        try:
            return runner.run(_serve_until_signal(config, ns.host, ns.port))
        except OSError as exc:
            print(f"sim: cannot listen on {ns.host}:{ns.port}: {exc}", file=sys.stderr)
            return 1


async def _serve_until_signal(config: SimConfig, host: str, port: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    try:
        sim = await start_sim(config, host, port)
        try:
            print(f"sim: serving {config.model_name} on {sim.url}", file=sys.stderr, flush=True)
            await stop.wait()
        finally:
            await sim.close()
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
    return 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
