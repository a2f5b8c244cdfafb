#!/usr/bin/env bash
# GPU smoke test (tools/gpu_smoke.py): the GPU paths the CPU suite cannot run, ordered by risk, stopping at
# the first failure, one JSON report on stdout.
#   bash tools/gpu_smoke.sh --plan        what it carries (carry_bytes) and runs (steps, planned_seconds)
#   bash tools/gpu_smoke.sh --fetch       download the wheels a torch-only machine lacks, build the checkpoint
#   bash tools/gpu_smoke.sh [--out FILE]  run (PYTHON=... for another interpreter than .venv's)
# On a machine with torch alone, install the carried wheels first:
#   pip install --no-index --no-deps --target /tmp/site .gpu_smoke/wheels/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
exec "$PY" "$ROOT/tools/gpu_smoke.py" "$@"
