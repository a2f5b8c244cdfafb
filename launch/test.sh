#!/usr/bin/env bash
# The test suite: creates or reuses .venv (tools/setup_venv.sh), then runs pytest on tests/.
# Extra arguments go to pytest (e.g. `bash launch/test.sh -k config`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup_venv.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_AUTH_MODE=disabled
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=15 "$@"
