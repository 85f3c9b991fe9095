"""Small helpers every benchmark uses: what was measured, on what, and JSON-safe numbers."""

from __future__ import annotations

import math
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
#: Environment prefixes removed from child processes' environment: config
#: overrides and OpenTelemetry exporters would change what is measured.
SCRUBBED_ENV = ("ADMISSION_", "OTEL_")


def scrubbed_env() -> dict[str, str]:
    """This process's environment without ``SCRUBBED_ENV`` variables, for child servers."""
    return {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_ENV)}


def own_cpu() -> float:
    """User plus system CPU seconds of this process (the load generator)."""
    times = os.times()
    return times.user + times.system


def cpu_info() -> dict[str, str]:
    """The CPU's model name and feature flags (``/proc/cpuinfo``; empty elsewhere)."""
    found: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return {"cpu_model": platform.processor(), "cpu_flags": ""}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags") and key not in found:
            found[key] = value.strip()
    return {"cpu_model": found.get("model name", ""), "cpu_flags": found.get("flags", "")}


def machine(note: str) -> dict[str, Any]:
    """The machine and library versions a result was measured with."""
    return {
        **cpu_info(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "uvloop": metadata.version("uvloop"),
        "note": note,
    }


def revision() -> str:
    """The commit measured, with ``+dirty`` when ``proxy/`` has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "proxy"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
