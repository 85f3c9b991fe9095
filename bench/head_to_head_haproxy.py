"""HAProxy for the head-to-head benchmark: install it, render its config, start it.

Owns the one place the benchmark changes the machine: when ``haproxy`` is not
on ``PATH``, ``ensure_haproxy`` runs ``apt-get update`` and ``apt-get install
-y haproxy`` (Debian's package, as root), each bounded by a timeout. A failure
never raises: it comes back as a note, and the benchmark runs the other
targets and marks HAProxy as not measured. Debian's packages start no service
inside a container (``policy-rc.d``), and the benchmark runs its own HAProxy
in the foreground (``-db``) as a child process, stopped like every other one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template

TEMPLATE = Path(__file__).resolve().parent / "haproxy.cfg.tmpl"
APT_UPDATE_TIMEOUT_S = 180.0
APT_INSTALL_TIMEOUT_S = 300.0
READY_PATH = "/haproxy-ready"


@dataclass(frozen=True, slots=True)
class Install:
    """Where HAProxy is, or why it is not; ``how`` says what the script did."""

    path: str | None
    version: str
    how: str


def ensure_haproxy() -> Install:
    """HAProxy's path, installing it from Debian's packages when missing."""
    found = shutil.which("haproxy")
    if found is not None:
        return Install(found, _version(found), "already installed")
    if os.geteuid() != 0:
        return Install(None, "", "not installed, and installing it needs root")
    if shutil.which("apt-get") is None:
        return Install(None, "", "not installed, and there is no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (
        (["apt-get", "update"], APT_UPDATE_TIMEOUT_S),
        (["apt-get", "install", "-y", "--no-install-recommends", "haproxy"],
         APT_INSTALL_TIMEOUT_S),
    )  # fmt: skip
    for argv, timeout_s in steps:
        failure = _run(argv, timeout_s, env)
        if failure is not None:
            return Install(None, "", failure)
    found = shutil.which("haproxy")
    if found is None:
        return Install(None, "", "apt-get install haproxy succeeded but no haproxy on PATH")
    return Install(found, _version(found), "installed now with apt-get install haproxy")


def _run(argv: list[str], timeout_s: float, env: dict[str, str]) -> str | None:
    """Run one install step; None when it worked, else why it did not."""
    command = " ".join(argv)
    try:
        done = subprocess.run(
            argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"`{command}` took over {timeout_s:.0f} s"
    except OSError as exc:
        return f"`{command}` could not run: {exc}"
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
        return f"`{command}` exited with {done.returncode}: {' / '.join(tail)}"
    return None


def _version(path: str) -> str:
    try:
        done = subprocess.run(
            [path, "-v"], capture_output=True, timeout=10.0, check=False
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    first = done.stdout.decode(errors="replace").strip().splitlines()
    return first[0] if first else "unknown"


def render_config(
    port: int,
    replicas: Sequence[tuple[str, str]],
    *,
    maxconn: int,
    queue_ms: int,
    total_ms: int,
    connect_ms: int,
) -> str:
    """The config text: ``replicas`` are (name, ``host:port``) pairs, each at ``maxconn``."""
    servers = "\n".join(
        f"    server {name} {address} maxconn {maxconn}" for name, address in replicas
    )
    return Template(TEMPLATE.read_text()).substitute(
        port=port, servers=servers, queue_ms=queue_ms, total_ms=total_ms, connect_ms=connect_ms
    )


def check_config(path: str, config: Path) -> None:
    """``haproxy -c``: a bad config fails here, not as a server that never gets ready."""
    done = subprocess.run(
        [path, "-c", "-f", str(config)], capture_output=True, timeout=10.0, check=False
    )  # fmt: skip
    if done.returncode != 0:
        output = (done.stdout + done.stderr).decode(errors="replace").strip()
        raise RuntimeError(f"haproxy rejected {config}:\n{output}")


def argv(path: str, config: Path) -> list[str]:
    """Foreground (``-db``), so it is our child and stops with SIGTERM."""
    return [path, "-f", str(config), "-db"]
