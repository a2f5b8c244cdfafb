#!/usr/bin/env bash
# The test suite: creates or reuses .venv (tools/setup_venv.sh), runs `ruff check .` (settings in
# pyproject.toml; a lint failure fails the run before any test starts), then runs pytest on tests/.
# Extra arguments go to pytest (e.g. `bash launch/test.sh -k config`; `-n 0` runs in one process).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup_venv.sh
.venv/bin/ruff check .
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_AUTH_MODE=disabled
# Two workers, one test file each at a time: most of the suite is process start-up (Ray, SGLang
# servers, gloo ranks), which is CPU work: on 2 cores two workers kept them 91% busy and three were
# slower (2026-12-02). Files are handed out in collection order, the longest first
# (tests/conftest.py, LONGEST_FIRST), not pytest-xdist's most-tests-first.
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=15 -n 2 --dist loadfile \
  --no-loadscope-reorder "$@"
