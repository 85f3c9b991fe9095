# Sourced by scripts/demo and scripts/test: make .venv and install the project.
# Re-running is cheap: pip skips what is already installed. pip's output
# (setuptools' editable-install warnings included) goes to .venv/bootstrap.log
# and is shown only when a step fails, so the demo and the tests start with
# their own first lines.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "Python 3.11 or newer is required (set PYTHON=/path/to/python3.11)" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
BOOTSTRAP_LOG=.venv/bootstrap.log
: >"$BOOTSTRAP_LOG"
_bootstrap_step() {
    # Runs one install step with its output in the log; on failure prints the
    # log's tail and where the whole log is, and exits with the step's status.
    local rc=0
    "$@" >>"$BOOTSTRAP_LOG" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "bootstrap failed (exit $rc): $*" >&2
        echo "---- last 40 lines of $BOOTSTRAP_LOG ----" >&2
        tail -n 40 "$BOOTSTRAP_LOG" >&2
        echo "---- full log: $BOOTSTRAP_LOG ----" >&2
        exit "$rc"
    fi
}
_bootstrap_step .venv/bin/python -m pip install --disable-pip-version-check --upgrade pip
_bootstrap_step .venv/bin/python -m pip install --disable-pip-version-check -e ".[loadtest${EXTRAS:+,$EXTRAS}]"
