"""The JSON Schema of the config file, generated from the config model.

Why it exists: editors that speak yaml-language-server (VS Code's YAML
extension, Neovim, JetBrains) validate and complete a config file from the
``# yaml-language-server: $schema=...`` line at its top, so an operator sees a
misspelt key, a negative budget or an unknown ``jitter`` while typing, before
``check-config`` or a failed rollout. The schema is derived from ``Config``
(``Config.model_json_schema()``), never written by hand, so it cannot say
anything the model does not; the committed ``config/schema.json`` is compared
with a fresh generation by the tests, and ``--check`` lets CI do the same.

What it cannot say: the rules *between* fields (budgets that fit ``total_ms``,
unique replica names and keys, ``anonymous`` naming a tenant, a tenant's class
being defined) live in the model's validators. ``check-config`` stays the
authority; the schema is the fast first pass.

    python -m proxy.schema            # print the schema
    python -m proxy.schema --write    # rewrite config/schema.json
    python -m proxy.schema --check    # exit 1 when config/schema.json is not current

The output is deterministic (sorted keys, two-space indent, trailing newline),
so a regenerated file differs only where the model did. Nothing here reads the
environment: ``ADMISSION_*`` overrides change a config, not its schema.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from proxy.settings import Config

#: Where the committed schema lives in a source checkout.
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "config" / "schema.json"
#: The dialect pydantic generates; stated so that editors and validators agree on it.
DIALECT = "https://json-schema.org/draft/2020-12/schema"
TITLE = "admission-proxy configuration"

EXIT_OK = 0
EXIT_STALE = 1


def config_schema() -> dict[str, Any]:
    """The schema as a dict: the model's own, with its dialect and a readable title."""
    schema = Config.model_json_schema()
    return {**schema, "$schema": DIALECT, "title": TITLE}


def render() -> str:
    """The schema as the exact text committed in ``config/schema.json``."""
    return json.dumps(config_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def check(path: Path, err: TextIO = sys.stderr) -> int:
    """``EXIT_OK`` when the file at ``path`` holds exactly the generated schema."""
    try:
        current = path.read_text(encoding="utf-8")
    except OSError as exc:
        err.write(f"cannot read {path}: {exc}\n")
        return EXIT_STALE
    if current != render():
        err.write(f"{path} is not the schema of the current config model; run\n")
        err.write("    python -m proxy.schema --write\n")
        return EXIT_STALE
    return EXIT_OK


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.schema",
        description="Print, write or check the JSON Schema of the config file.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the schema file")
    mode.add_argument("--check", action="store_true", help="exit 1 when the file is not current")
    parser.add_argument(
        "--path", type=Path, default=SCHEMA_PATH, help="schema file (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.check:
        return check(args.path)
    if args.write:
        args.path.write_text(render(), encoding="utf-8")
        return EXIT_OK
    out.write(render())
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
