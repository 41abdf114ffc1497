#!/usr/bin/env bash
# The README's test command: set up (or reuse) the environment, then run the test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not slow"`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export TRITON_INTERPRET=1
exec python -m pytest -q -n 2 --dist loadfile "$@" tests
