#!/usr/bin/env bash
# Create or reuse the project's Python 3.12 virtual environment at .venv (repo root).
#
# Every version comes from requirements.lock, which names every package the install needs; all go
# in with --no-deps (sglang's and megatron-bridge's declared requirements pull GPU-only kernels or
# conflict on transformers), and `pip check` then fails the install on any requirement the lock
# misses (those two's known gaps excepted). The lock goes in as two halves by two pip processes at once (distinct packages, so
# distinct files): unpacking the wheels is most of the install and one pip uses one core.
# Re-running on an up-to-date .venv takes about a second: a stamp holds the hash of the lock,
# this script, tools/declare_top_level.py and setup.py, and the install is skipped when it matches.
#   env: PYTHON=/path/to/python3.12 (default: pyenv's 3.12.1, else python3.12 on PATH)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
LOCK="$ROOT/requirements.lock"
STAMP="$VENV/.megarl-installed"
WANT="$(cat "$LOCK" "$ROOT/tools/setup_venv.sh" "$ROOT/tools/declare_top_level.py" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=3.12.1 pyenv which python3.12 >/dev/null 2>&1; then
    PYENV_VERSION=3.12.1 pyenv which python3.12; return
  fi
  command -v python3.12 || { echo "setup_venv: Python 3.12 not found (set PYTHON=...)" >&2; exit 1; }
}

if [ ! -x "$VENV/bin/python" ]; then
  "$(find_python)" -m venv "$VENV"
fi
"$VENV/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || { echo "setup_venv: $VENV is not Python 3.12; remove it and re-run" >&2; exit 1; }

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q pip==26.3
HALVES="$(mktemp -d)"
trap 'rm -rf "$HALVES"' EXIT
grep -E '^[A-Za-z0-9]' "$LOCK" | awk -v dir="$HALVES" '{ print > (dir "/half" NR % 2 ".txt") }'
"${PIP[@]}" install -q --no-deps -r "$HALVES/half0.txt" & FIRST=$!
"${PIP[@]}" install -q --no-deps -r "$HALVES/half1.txt" & SECOND=$!
wait "$FIRST" || { wait "$SECOND" || true; echo "setup_venv: installing requirements.lock failed" >&2; exit 1; }
wait "$SECOND" || { echo "setup_venv: installing requirements.lock failed" >&2; exit 1; }
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$ROOT"

# Only the known gaps of sglang and megatron-bridge may be reported by pip check (on a GPU machine,
# tools/setup_gpu_venv.sh installs sglang's flashinfer-python, not the one megatron-bridge declares).
UNEXPECTED="$("${PIP[@]}" check 2>&1 \
  | grep -v -E '^(sglang [0-9.]+|megatron-bridge [0-9.]+) requires .*, which is not installed\.$' \
  | grep -v -E '^megatron-bridge [0-9.]+ has requirement (transformers|flashinfer-python).*, but you have .*\.$' \
  | grep -v -E '^No broken requirements found\.$' || true)"
if [ -n "$UNEXPECTED" ]; then echo "setup_venv: unexpected pip check output:" >&2; echo "$UNEXPECTED" >&2; exit 1; fi
# Every process importing transformers maps packages to distributions; declared names save it 0.6 s
"$VENV/bin/python" "$ROOT/tools/declare_top_level.py"
echo "$WANT" > "$STAMP"
echo "setup_venv: $VENV ready"
