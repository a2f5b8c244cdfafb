#!/bin/bash
# Submit a recipe with as many nodes as the planner says it needs:
#   slurm/submit.sh recipe=glm45_355b_a32b [overrides...]
# Runs `python -m megarl.plan` on the recipe and overrides (refusing a layout that does not fit),
# takes its GPU count (trainer, plus engines when disaggregated, plus a teacher's, judge's or frozen
# agent role's engines), and calls
#   sbatch --nodes=ceil(GPUs / GPUS_PER_NODE) --gpus-per-node=GPUS_PER_NODE slurm/megarl.sbatch ARGS
# GPUS_PER_NODE defaults to 8; SBATCH_ARGS (split on spaces) go to sbatch before the script.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${MEGARL_PYTHON:-python}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
read -r -a EXTRA <<< "${SBATCH_ARGS:-}"
plan_json="$(mktemp)"
trap 'rm -f "$plan_json"' EXIT
(cd "$ROOT" && "$PYTHON" -m megarl.plan "$@" --json "$plan_json" > /dev/null) \
  || { echo "submit: the planner refused the layout (see above); nothing submitted" >&2; exit 1; }
gpus="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["total_gpus"])' "$plan_json")"
nodes=$(((gpus + GPUS_PER_NODE - 1) / GPUS_PER_NODE))
echo "submit: $gpus GPUs -> $nodes nodes x $GPUS_PER_NODE GPUs"
# not exec: the EXIT trap removes the plan file once sbatch has returned
sbatch --nodes="$nodes" --gpus-per-node="$GPUS_PER_NODE" "${EXTRA[@]}" "$ROOT/slurm/megarl.sbatch" "$@"
