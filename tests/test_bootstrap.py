"""scripts/bootstrap.sh is quiet when pip succeeds and loud when it fails.

Run against a copy of the script whose ``.venv/bin/python`` is a stand-in that
prints pip-like noise and exits with a chosen status: no network, no venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOISE = "BuildBackendWarning: Editable installation."


def _checkout(tmp_path: Path, rc: int) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho '{NOISE}'\necho \"$@\" >&2\nexit {rc}\n")
    python.chmod(0o755)
    return tmp_path


def _source(checkout: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "EXTRAS"}
    return subprocess.run(
        ["bash", "-c", "source scripts/bootstrap.sh; echo demo-first-line"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_pip_output_is_kept_out_of_the_way_on_success(tmp_path: Path) -> None:
    """Success prints nothing: the next command's first line is the first line seen."""
    checkout = _checkout(tmp_path, 0)
    result = _source(checkout)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "demo-first-line\n"
    assert result.stderr == ""
    assert NOISE in (checkout / ".venv" / "bootstrap.log").read_text()


@pytest.mark.parametrize("rc", [1, 7])
def test_a_failed_install_exits_non_zero_and_shows_the_log(tmp_path: Path, rc: int) -> None:
    """A failing step stops the script with its status and prints the log's tail."""
    result = _source(_checkout(tmp_path, rc))
    assert result.returncode == rc
    assert "demo-first-line" not in result.stdout
    assert f"bootstrap failed (exit {rc})" in result.stderr
    assert NOISE in result.stderr
    assert ".venv/bootstrap.log" in result.stderr
