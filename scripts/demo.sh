#!/usr/bin/env bash
# The README's main-job command: set up (or reuse) the environment, then run `mfqat demo`.
# Extra arguments go to the demo (e.g. `bash scripts/demo.sh --steps 120 --force`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec python -m mfqat.cli demo "$@"
