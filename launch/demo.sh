#!/usr/bin/env bash
# The default demo on CPU: creates or reuses .venv, then runs recipes/tiny_moe_cpu.yaml.
# Extra arguments are Hydra overrides (e.g. `bash launch/demo.sh warmup.steps=100`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup_venv.sh
exec .venv/bin/python -m megarl.train recipe=tiny_moe_cpu "$@"
