"""scripts/install-redis: silent when redis-server is there, one skip line where it cannot install.

Run with a PATH of stand-ins (``id``, ``redis-server``): no apt, no network.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, stubs: dict[str, str]) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in stubs.items():
        stub = bin_dir / name
        stub.write_text(f"#!/bin/sh\n{body}\n")
        stub.chmod(0o755)
    bash = shutil.which("bash")
    assert bash is not None
    return subprocess.run(
        [bash, str(ROOT / "scripts" / "install-redis")],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_nothing_to_do_when_redis_server_is_on_path(tmp_path: Path) -> None:
    result = _run(tmp_path, {"redis-server": "exit 0", "id": "echo 0"})
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_without_root_or_apt_it_says_the_tests_will_be_skipped(tmp_path: Path) -> None:
    """Not root, no apt-get: one line, exit 0, so the rest of scripts/test runs."""
    result = _run(tmp_path, {"id": "echo 1000"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1
    assert "the Redis tests will be skipped" in result.stdout
