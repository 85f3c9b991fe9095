"""The ``admission-proxy`` command line (docs/REFERENCE.md).

admission-proxy serve --config PATH [--host H] [--port P] [--workers N]
admission-proxy sim --port P [--slots N] [--seed S] [...]
admission-proxy demo [--duration S] [--config PATH] [--mode enforce|observe]
admission-proxy check-config PATH [--workers N]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from proxy.config_warnings import config_warnings
from proxy.loadtest.cli import add_loadtest_arguments, run_loadtest
from proxy.settings import ConfigError, dump_effective_config, load_config
from proxy.tasks import run_async
from proxy.telemetry.logs import configure_logging
from proxy.workers import supervise, workers_refusal

EXIT_OK = 0
#: Same code as a usage error: the input, not the program, is at fault.
EXIT_INVALID = 2


def check_config(
    path: str, out: TextIO = sys.stdout, err: TextIO = sys.stderr, workers: int = 1
) -> int:
    """Validate ``path``; print the effective config to ``out`` or the problems to ``err``.

    ``workers``: the ``serve --workers`` it is meant for (N > 1 needs Redis).

    Keys are masked in the output: it is meant to be pasted into tickets and
    CI logs, where a live key must never appear. Settings that do nothing
    (``config_warnings``) are listed on ``err`` as ``warning:`` lines; they do
    not change the exit code.
    """
    try:
        config = load_config(path)
    except ConfigError as exc:
        count = len(exc.issues)
        err.write(f"invalid config {path}: {count} problem{'s' if count != 1 else ''}\n")
        for issue in exc.issues:
            err.write(f"{issue}\n")
        return EXIT_INVALID
    refusal = workers_refusal(config, workers)
    if refusal is not None:
        err.write(f"invalid config {path}: {refusal}\n")
        return EXIT_INVALID
    for warning in config_warnings(config):
        err.write(f"warning: {warning}\n")
    out.write(dump_effective_config(config, mask_secrets=True))
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    from proxy.sim.cli import add_sim_arguments

    parser = argparse.ArgumentParser(
        prog="admission-proxy",
        description="Admission-control reverse proxy for GPU inference replicas.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", required=True, help="path to the YAML config")
    serve.add_argument("--host", help="listen address (default: server.host)")
    serve.add_argument("--port", type=int, help="listen port (default: server.port)")
    serve.add_argument(
        "--workers", type=int, default=1,
        help="processes sharing the port (N > 1 needs state.backend: redis)",
    )  # fmt: skip
    # Set by the parent of ``--workers N`` on each worker: bind with SO_REUSEPORT.
    serve.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)

    sim = sub.add_parser("sim", help="run one simulated GPU replica")
    add_sim_arguments(sim)

    demo = sub.add_parser("demo", help="two simulated replicas, the proxy and mixed traffic")
    demo.add_argument("--duration", type=float, default=20.0, help="seconds of traffic")
    demo.add_argument("--config", help="demo config (default: config/demo.yaml)")
    demo.add_argument("--mode", choices=["enforce", "observe"], help="override the config's mode")

    check = sub.add_parser("check-config", help="validate a config and print it in full")
    check.add_argument("path")
    check.add_argument("--workers", type=int, default=1, help="check for serve --workers N")

    add_loadtest_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        return check_config(args.path, workers=args.workers)
    if args.command == "loadtest":
        return run_loadtest(args)
    configure_logging()
    if args.command == "serve":
        try:
            config = load_config(args.config)
        except ConfigError as exc:
            print(f"invalid config {args.config}:\n{exc}", file=sys.stderr)
            return EXIT_INVALID
        refusal = workers_refusal(config, args.workers)
        if refusal is not None:
            print(f"invalid config {args.config}: {refusal}", file=sys.stderr)
            return EXIT_INVALID
        if not args.reuse_port:  # a worker of ``--workers N``: its parent said it once
            for warning in config_warnings(config):
                print(f"warning: {warning}", file=sys.stderr)
        host = args.host or config.server.host
        port = args.port if args.port is not None else config.server.port
        if args.workers > 1:
            return supervise(args.config, host, port, args.workers)
        from proxy.lifecycle import serve

        return run_async(
            serve(config, host, port, config_path=args.config, reuse_port=args.reuse_port)
        )
    if args.command == "sim":
        from proxy.sim.cli import run_sim

        return run_sim(args)
    if args.command == "demo":
        from proxy.demo import run_demo

        return run_async(
            run_demo(duration_s=args.duration, config_path=args.config, mode=args.mode)
        )
    raise AssertionError(args.command)
