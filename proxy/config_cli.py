"""``admission-proxy check-config PATH``: validate a config file before it is deployed.

Prints the effective config (every default filled in, environment overrides
applied, API keys masked) and exits 0, or lists every problem by its YAML path
and exits 2, so a CI step or an operator sees all mistakes in one run. The
command is read-only: it never contacts a replica.
"""

from __future__ import annotations

import sys
from typing import TextIO

from proxy.settings import ConfigError, dump_effective_config, load_config

EXIT_OK = 0
#: Same code as a usage error: the input, not the program, is at fault.
EXIT_INVALID = 2


def check_config(path: str, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Validate ``path``; print the effective config to ``out`` or the problems to ``err``.

    Keys are masked in the output: it is meant to be pasted into tickets and
    CI logs, where a live key must never appear.
    """
    try:
        config = load_config(path)
    except ConfigError as exc:
        count = len(exc.issues)
        err.write(f"invalid config {path}: {count} problem{'s' if count != 1 else ''}\n")
        for issue in exc.issues:
            err.write(f"{issue}\n")
        return EXIT_INVALID
    out.write(dump_effective_config(config, mask_secrets=True))
    return EXIT_OK
