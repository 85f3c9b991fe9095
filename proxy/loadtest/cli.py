"""The ``admission-proxy loadtest`` subcommand: ``staircase`` and ``phases``.

Owns the arguments and what the command prints. ``add_loadtest_arguments``
registers the subcommand on the main parser; ``run_loadtest`` runs it and
returns the exit status:

- 0: the run finished and its report is written (staircase: with a
  recommended ``max_concurrency``);
- 1: the run finished but found nothing usable (no safe level; no request
  answered at all);
- 2: invalid arguments or workload file (every problem listed).

Nothing heavy is imported until a run starts, so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar

__all__ = ["add_loadtest_arguments", "run_loadtest"]

_N = TypeVar("_N", int, float)

STAIRCASE_HELP = """\
Closed-loop concurrency levels against any OpenAI-compatible URL (a replica
directly, or the proxy). Each level discards its warm-up, then measures
req/s, output tokens/s, latency p50/p95/p99, TTFT p50/p95, queue wait
(Server-Timing through the proxy, x-queue-time from TGI-style engines),
errors by kind and memory (engine KV cache from /metrics, else the proxy's
admission_gpu_memory_used_ratio, else the KV cache of the proxy's replicas
from its /admin/state).

Stop lines: p99 over twice the first level's, any error, memory over 90%
used (engine KV cache or GPU memory) or under 1 GiB of GPU memory free.
A level that trips one is re-run once; the line counts only when it holds
again (or at the next level), so one noisy level never decides. The run
stops at a confirmed stop line.

Each level also records CPU and resident memory of the proxy and of the
engines on this machine (/proc; a remote process's process_cpu_seconds_total
from its /metrics), GPU utilisation and memory (NVML when the target is on
this machine, else the proxy's own GPU readings), and whether the target was
idle when the level started (the proxy's /admin/state, else the engine's
/metrics). Levels are separated by --cool-down seconds (default 30, the
operator notes' sleep 30; 1 when the target is a simulator or the proxy in
front of simulators only).

The throughput knee is the last level whose throughput rose at least 10%,
error-free; the latency limit is the last level before the confirmed stop
line. The recommended max_concurrency is the smaller of the two, or with
--p99-slo-ms the last level whose p99 met the SLO.

Writes report.md, report.json, report.csv, latency.png and throughput.png
into --out, and prints a max_concurrency snippet for the config (through the
proxy: a comment saying what was measured, since that is no replica's knee).

example:
  admission-proxy loadtest staircase --url http://127.0.0.1:8000 \\
      --levels 1,2,4,8,16,32 --requests-per-level 200 --max-tokens 256 \\
      --input-tokens 256:1024 --out reports/gpu-0
"""

PHASES_HELP = """\
Open-loop Poisson arrivals through the proxy in the phases of a workload
file (baseline, ramp, burst, recovery), from several tenants with their
priorities, SLOs and a short/medium/long request mix; a phase may switch a
simulator fault on (POST /sim/faults on a --fault-url) for its duration.

Reports goodput (requests that succeeded and met every SLO of their
tenant), rejections and failures by reason, queue depth over time (from the
proxy's /metrics), the proxy's retries, and how long the queues took to
drain after the burst. The generator reports the rate it achieved next to
the rate asked.

Ends with the capacity table: stable load (busiest fault-free phase with 95%
of its requests good), acceptable peak (the same with 80%), burst protection
(queue drain time after the burst, and what the burst cost) and fault
degradation (good share while a fault was on), each with the proxy config
that produced it (SHA-256 of GET /admin/config and its seats, queues, retry).

Writes report.md, report.json, report.csv (the timeline), requests.csv and
timeline.png into --out. See config/workload.example.yaml.

example:
  admission-proxy loadtest phases --url http://127.0.0.1:8080 \\
      --workload config/workload.example.yaml --fault-url http://127.0.0.1:9001
"""


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if not levels or any(c < 1 for c in levels) or list(levels) != sorted(set(levels)):
        raise argparse.ArgumentTypeError("levels must be increasing positive integers, e.g. 1,2,4")
    return levels


def _token_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        pair = (int(low), int(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX (or N), got {text!r}") from None
    if pair[0] < 1 or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError("expected 1 <= MIN <= MAX")
    return pair


def _positive(kind: Callable[[str], _N], what: str, rule: str) -> Callable[[str], _N]:
    """An argparse ``type=`` for a number above zero; ``rule`` says so in its own terms."""

    def parse(text: str) -> _N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(rule)
        return value

    return parse


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


_positive_int = _positive(int, "an integer", "must be >= 1")
_positive_float = _positive(float, "a number", "must be > 0")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", required=True, help="base URL of the target, e.g. http://host:8080"
    )
    parser.add_argument("--out", help="report directory (default: loadtest-<kind>-<time>)")
    metrics = parser.add_mutually_exclusive_group()
    metrics.add_argument("--metrics-url", help="Prometheus text to scrape (default: URL/metrics)")
    metrics.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    parser.add_argument(
        "--admin-token-env",
        help="environment variable holding the proxy's admin token (for /admin/state and "
        "/admin/config; not needed from loopback when the proxy has no token set)",
    )


def add_loadtest_arguments(subparsers: Any) -> None:
    """Register ``loadtest staircase`` and ``loadtest phases`` on the main parser."""
    formatter = argparse.RawDescriptionHelpFormatter
    loadtest = subparsers.add_parser(
        "loadtest",
        help="capacity tests: staircase (find max_concurrency) and phases (goodput)",
        description="Capacity tests (docs/REFERENCE.md). Every run is bounded and ends itself.",
    )
    kinds = loadtest.add_subparsers(dest="loadtest_command", required=True)

    stair = kinds.add_parser(
        "staircase",
        help="closed-loop concurrency levels; names the knee",
        description=STAIRCASE_HELP,
        formatter_class=formatter,
    )
    _common(stair)
    stair.add_argument(
        "--levels",
        type=_levels,
        default=(1, 2, 4, 8, 16, 32),
        help="concurrency levels (default 1,2,4,8,16,32)",
    )
    amount = stair.add_mutually_exclusive_group()
    amount.add_argument(
        "--requests-per-level",
        type=_positive_int,
        help="measured requests per level, after warm-up (default 100)",
    )
    amount.add_argument(
        "--seconds-per-level", type=_positive_float, help="measured seconds per level instead"
    )
    stair.add_argument(
        "--warmup",
        type=int,
        help="requests discarded at the start of each level (default: one per worker)",
    )
    stair.add_argument("--max-tokens", type=_positive_int, default=128, help="default 128")
    stair.add_argument(
        "--input-tokens",
        type=_token_range,
        default=(128, 512),
        metavar="MIN:MAX",
        help="prompt length range, uniform (default 128:512)",
    )
    stair.add_argument(
        "--model",
        help="model name sent in every request; through the proxy it picks the model pool "
        "measured (default: the first of URL/v1/models)",
    )
    stair.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    key = stair.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="sent as 'Authorization: Bearer' (visible in ps)")
    key.add_argument("--api-key-env", help="environment variable holding the API key")
    stair.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask vLLM/SGLang to generate exactly max_tokens (fixed output length)",
    )
    stair.add_argument(
        "--p99-slo-ms",
        type=_positive_float,
        help="recommend the last level whose p99 latency meets this SLO",
    )
    stair.add_argument("--request-timeout-s", type=_positive_float, default=120.0)
    stair.add_argument(
        "--level-timeout-s",
        type=_positive_float,
        default=600.0,
        help="a level gives up after this long (default 600)",
    )
    stair.add_argument("--seed", type=int, default=0, help="prompt-length draws (default 0)")
    stair.add_argument(
        "--cool-down",
        type=_non_negative_float,
        metavar="SECONDS",
        help="pause between levels (default 30; 1 against simulators)",
    )
    stair.add_argument(
        "--no-rerun",
        action="store_true",
        help="confirm a stop line at the next level instead of re-running the level",
    )

    phases = kinds.add_parser(
        "phases",
        help="open-loop phases through the proxy; goodput, rejections, drain",
        description=PHASES_HELP,
        formatter_class=formatter,
    )
    _common(phases)
    phases.add_argument("--workload", required=True, help="workload YAML file")
    phases.add_argument(
        "--model",
        help="model (pool) every request names, overriding the workload's model key",
    )
    phases.add_argument(
        "--duration-scale",
        type=_positive_float,
        default=1.0,
        metavar="FACTOR",
        help="multiply every phase's duration_s by FACTOR (0.25: a quarter-length rehearsal)",
    )
    phases.add_argument(
        "--fault-url",
        action="append",
        default=[],
        help="a simulator's URL for phase faults (repeat; a fault's target indexes these)",
    )


def _out_dir(ns: argparse.Namespace, kind: str) -> Path:
    if ns.out:
        return Path(ns.out)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(f"loadtest-{kind}-{stamp}")


def _metrics_url(ns: argparse.Namespace) -> str | None:
    return "" if ns.no_metrics else ns.metrics_url


def _admin_token(ns: argparse.Namespace) -> tuple[str | None, str | None]:
    """The admin token named by ``--admin-token-env``, or the error to print."""
    if not ns.admin_token_env:
        return None, None
    token = os.environ.get(ns.admin_token_env)
    if not token:
        return None, f"environment variable {ns.admin_token_env} is not set"
    return token, None


def run_loadtest(ns: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the parsed ``loadtest`` command; returns the exit status (stdout by default)."""
    from proxy.tasks import run_async

    out = out or sys.stdout
    if ns.loadtest_command == "staircase":
        return run_async(_staircase(ns, out))
    return run_async(_phases(ns, out))


async def _staircase(ns: argparse.Namespace, out: TextIO) -> int:
    from proxy.loadtest.progress import Progress
    from proxy.loadtest.report import max_concurrency_snippet, write_staircase_report
    from proxy.loadtest.staircase import StaircasePlan, run_staircase

    api_key = ns.api_key
    if ns.api_key_env:
        api_key = os.environ.get(ns.api_key_env)
        if not api_key:
            print(f"environment variable {ns.api_key_env} is not set", file=sys.stderr)
            return 2
    admin_token, problem = _admin_token(ns)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    requests = ns.requests_per_level
    if requests is None and ns.seconds_per_level is None:
        requests = 100
    try:
        plan = StaircasePlan(
            url=ns.url,
            levels=ns.levels,
            requests_per_level=requests,
            seconds_per_level=ns.seconds_per_level,
            warmup=ns.warmup,
            max_tokens=ns.max_tokens,
            input_tokens=ns.input_tokens,
            endpoint=ns.endpoint,
            model=ns.model,
            api_key=api_key,
            ignore_eos=ns.ignore_eos,
            p99_slo_ms=ns.p99_slo_ms,
            request_timeout_s=ns.request_timeout_s,
            level_timeout_s=ns.level_timeout_s,
            metrics_url=_metrics_url(ns),
            seed=ns.seed,
            rerun=not ns.no_rerun,
            cool_down_s=ns.cool_down,
            admin_token=admin_token,
        )
    except ValueError as exc:
        print(f"invalid staircase: {exc}", file=sys.stderr)
        return 2
    progress = Progress(None if ns.quiet else sys.stderr)
    result = await run_staircase(plan, progress)
    out_dir = _out_dir(ns, "staircase")
    await asyncio.to_thread(write_staircase_report, result, out_dir)  # matplotlib blocks
    verdict = result.verdict
    print(verdict.explanation, file=out)
    print(f"model: {result.model}", file=out)
    for note in [*verdict.notes, *result.notes, *result.resource_notes]:
        print(f"note: {note}", file=out)
    print("\n" + max_concurrency_snippet(result) + "\n", file=out)
    print(f"report: {out_dir / 'report.md'}", file=out)
    return 0 if verdict.recommended_max_concurrency is not None else 1


async def _phases(ns: argparse.Namespace, out: TextIO) -> int:
    from proxy.loadtest.phases import PhasesPlan, resolve_fault_url, run_phases
    from proxy.loadtest.phases_report import write_phases_report
    from proxy.loadtest.progress import Progress
    from proxy.loadtest.workload import WorkloadError, load_workload, scale_durations

    try:
        workload = scale_durations(load_workload(ns.workload), ns.duration_scale)
    except WorkloadError as exc:
        print(f"invalid workload {ns.workload}:\n{exc}", file=sys.stderr)
        return 2
    admin_token, problem = _admin_token(ns)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    plan = PhasesPlan(
        url=ns.url,
        workload=workload,
        workload_source=ns.workload,
        fault_urls=tuple(ns.fault_url),
        metrics_url=_metrics_url(ns),
        model=ns.model,
        admin_token=admin_token,
    )
    missing = [
        f"tenants.{name}.api_key_env: {tenant.api_key_env} is not set"
        for name, tenant in workload.tenants.items()
        if tenant.api_key_env and not tenant.key()
    ]
    for index, phase in enumerate(workload.phases):
        if phase.fault is not None:
            try:
                resolve_fault_url(phase.fault, plan.fault_urls)
            except ValueError as exc:
                missing.append(f"phases[{index}].fault.target: {exc}")
    if missing:
        print(f"cannot run {ns.workload}:\n" + "\n".join(missing), file=sys.stderr)
        return 2
    result = await run_phases(plan, Progress(None if ns.quiet else sys.stderr))
    out_dir = _out_dir(ns, "phases")
    await asyncio.to_thread(write_phases_report, result, out_dir)
    summary = result.summary
    total = summary.total
    drain = summary.drain
    drain_text = "-" if drain.drain_s is None else f"{drain.drain_s:.1f} s"
    print(
        f"goodput {total.goodput_per_s:.2f} req/s ({total.good} good of {total.sent} sent); "
        f"queues drained {drain_text} after {drain.phase}",
        file=out,
    )
    for note in result.generator_notes:
        print(f"note: {note}", file=out)
    for row in result.capacity:
        print(f"{row.title}: {row.value_text()} ({row.detail})", file=out)
    print(f"report: {out_dir / 'report.md'}", file=out)
    return 0 if total.ok > 0 else 1
