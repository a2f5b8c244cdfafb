#!/usr/bin/env bash
# Create or reuse the project's .venv for a CUDA 13 GPU machine: tools/setup_venv.sh (requirements.lock),
# then requirements-gpu.lock on top.
#
# Every wheel of the GPU lock goes in with --no-deps (the lock names each dependency; `pip check` below
# fails the install on one it misses). transformer_engine_torch is published only as an sdist that builds
# against the torch it finds: it goes in last, with --no-build-isolation (against the locked torch, not a
# newer one pip would fetch into an isolated build), compiled with the host's C++ compiler and, by
# default, the CUDA headers of the nvidia-* wheels just installed (NVTE_BUILD_USE_NVIDIA_WHEELS=0 and
# CUDA_HOME=/usr/local/cuda take a CUDA 13 toolkit's instead), for the architectures of NVTE_CUDA_ARCHS
# only (default: those of this machine's GPUs, from nvidia-smi; else Hopper and Blackwell, 90;100: without
# it the build covers every architecture and takes hours), without transformer-engine's optional NCCL EP
# extension (NVTE_WITH_NCCL_EP=0: it needs NCCL's device API headers, and megarl's MoE dispatchers are
# megatron-core's). A stamp of both locks, this script and the architectures skips an up-to-date install.
#   env: PYTHON as for tools/setup_venv.sh; MAX_JOBS (the build's parallel compilations, default: all cores);
#   NVTE_CUDA_ARCHS; NVTE_BUILD_THREADS_PER_JOB (nvcc threads per compilation, default 1)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
GPU_LOCK="$ROOT/requirements-gpu.lock"
STAMP="$VENV/.megarl-gpu-installed"

bash "$ROOT/tools/setup_venv.sh"
if [ -z "${NVTE_CUDA_ARCHS:-}" ]; then
  NVTE_CUDA_ARCHS="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | sort -u \
    | paste -sd ';' || true)"
fi
NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS:-90;100}"
WANT="$( (cat "$ROOT/requirements.lock" "$GPU_LOCK" "$ROOT/tools/setup_gpu_venv.sh"; echo "$NVTE_CUDA_ARCHS") \
  | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
WHEELS="$(mktemp)"
trap 'rm -f "$WHEELS"' EXIT
grep -E '^[A-Za-z0-9]' "$GPU_LOCK" | grep -v -E '^transformer_engine_torch==' > "$WHEELS"
"${PIP[@]}" install -q --no-deps --only-binary :all: -r "$WHEELS"

TE_TORCH="$(grep -E '^transformer_engine_torch==' "$GPU_LOCK")"
echo "setup_gpu_venv: building $TE_TORCH for CUDA architectures $NVTE_CUDA_ARCHS"
NVTE_FRAMEWORK=pytorch NVTE_BUILD_USE_NVIDIA_WHEELS="${NVTE_BUILD_USE_NVIDIA_WHEELS:-1}" \
  NVTE_CUDA_ARCHS="$NVTE_CUDA_ARCHS" NVTE_WITH_NCCL_EP=0 NVTE_BUILD_THREADS_PER_JOB="${NVTE_BUILD_THREADS_PER_JOB:-1}" \
  "${PIP[@]}" install --no-deps --no-build-isolation --no-binary transformer_engine_torch "$TE_TORCH"

# sglang's and megatron-bridge's known gaps (as in tools/setup_venv.sh) and, with the GPU lock, the
# flashinfer-python of sglang's pin where megatron-bridge declares another; anything else fails.
UNEXPECTED="$("${PIP[@]}" check 2>&1 \
  | grep -v -E '^(sglang [0-9.]+|megatron-bridge [0-9.]+) requires .*, which is not installed\.$' \
  | grep -v -E '^megatron-bridge [0-9.]+ has requirement (transformers|flashinfer-python).*, but you have .*\.$' \
  | grep -v -E '^No broken requirements found\.$' || true)"
if [ -n "$UNEXPECTED" ]; then echo "setup_gpu_venv: unexpected pip check output:" >&2; echo "$UNEXPECTED" >&2; exit 1; fi
echo "$WANT" > "$STAMP"
echo "setup_gpu_venv: $VENV ready for CUDA"
