#!/usr/bin/env bash
# GPU smoke test: what the CPU suite cannot exercise, each check a short python snippet or driver
# run on the tiny demo model:
#   nccl_group       an NCCL trainer group (2 ranks with 2+ GPUs, else 1): all-reduce over the ranks
#   te_layers        transformer-engine layers: model.transformer_impl=transformer_engine, build + warm-up steps
#   sync_nccl        an RL run whose weight sync uses the distributed transport (NCCL broadcast)
#   sync_cuda_ipc    an RL run whose weight sync uses the tensor transport (CUDA IPC handles)
#   memory_release   one SGLang engine with --enable-memory-saver: release and resume of its weights and
#                    KV cache (device memory freed and taken again, same greedy output after a reload)
#   colocated_run    placement=colocated: engines paused and released around each training step
#   engine_tp2       one SGLang engine over 2 GPUs (--tp-size 2), routing and sampling mask returned
#   optimizer_offload  trainer.optimizer_cpu_offload in bfloat16: megatron-core's HybridDeviceOptimizer holds
#                    the Adam state in host memory; three supervised steps equal the on-device optimizer's
# It prints, for each, OK, FAILED (with the log's tail) or SKIPPED with the reason (a missing
# package, one GPU only), and exits 1 when a check that could run failed, else 0. On a machine
# without a GPU it says so and exits 0 without running anything.
#
# usage: bash tools/gpu_smoke.sh             (PYTHON=... to use another interpreter than .venv's;
#                                             GPU_SMOKE_TIMEOUT_S=... per check, default 900)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TIMEOUT_S="${GPU_SMOKE_TIMEOUT_S:-900}"

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "${gpus:-0}" -eq 0 ]; then
  echo "gpu_smoke: no GPU on this machine (nvidia-smi lists none); nothing was run"
  exit 0
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/megarl_gpu_smoke.XXXXXX")"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" RAY_AUTH_MODE=disabled PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_smoke: $gpus GPU(s); logs in $WORK"
nvidia-smi -L | sed 's/^/  /'

declare -a REPORT=()
failed=0

has_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

# check NAME SKIP_REASON COMMAND...: run COMMAND unless SKIP_REASON is set; record the outcome.
check() {
  local name="$1" skip="$2"
  shift 2
  if [ -n "$skip" ]; then
    REPORT+=("SKIPPED  $name: $skip")
    echo "--- $name: skipped ($skip)"
    return
  fi
  echo "--- $name: running"
  local t0=$SECONDS
  if timeout "$TIMEOUT_S" "$@" >"$WORK/$name.log" 2>&1; then
    REPORT+=("OK       $name ($((SECONDS - t0)) s): $(grep '^smoke:' "$WORK/$name.log" | tail -1 | cut -c8-)")
  else
    local rc=$?
    failed=1
    REPORT+=("FAILED   $name (exit $rc after $((SECONDS - t0)) s; log $WORK/$name.log)")
    tail -n 25 "$WORK/$name.log" | sed "s/^/  [$name] /"
  fi
}

# --- the snippets --------------------------------------------------------------------------------
cat >"$WORK/nccl_group.py" <<'EOF'
import sys

import torch
import torch.distributed as dist

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks


def body(rank, layout):
    t = torch.full((1,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    return dist.get_backend(), torch.cuda.get_device_name(), float(t.item())


n = int(sys.argv[1])
out = run_ranks(body, Layout(world_size=n), backend="nccl", timeout_s=600)
print(out)
assert all(b == "nccl" and s == n * (n + 1) / 2 for b, _, s in out), out
print(f"smoke: {n} NCCL rank(s) all-reduced on {out[0][1]}")
EOF

cat >"$WORK/optimizer_offload.py" <<'EOF'
import dataclasses
import sys

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks


def steps(rank, layout, hf_path, offload):
    """(losses, grad norms, devices of the Adam state) of three bfloat16 supervised steps."""
    import torch
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from megarl.config import default_config
    from megarl.trainer.model_setup import build_trainable
    from megarl.trainer.optimizer import OptimizerSettings
    from megarl.trainer.sft_step import supervised_step
    from megarl.trainer.token_batch import token_batch

    settings = dataclasses.replace(OptimizerSettings.from_config(default_config(), lr=1e-3), dtype="bfloat16",
                                   use_distributed_optimizer=True, cpu_offload=offload)
    trainable = build_trainable(hf_path, layout, settings, transformer_impl="local")
    gen = torch.Generator().manual_seed(0)
    batch = token_batch([torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 7, 9, 11)], [2] * 4)
    results = [supervised_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, 64, pack=True)
               for _ in range(3)]
    inner = [o.optimizer for o in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])]
    assert all(isinstance(o, HybridDeviceOptimizer) for o in inner) == offload, inner
    devices = {v.device.type for o in inner for state in o.state.values() for v in state.values()
               if torch.is_tensor(v) and v.numel() > 1}
    return [r.loss for r in results], [r.grad_norm for r in results], sorted(devices)


on_device = run_ranks(steps, Layout(), sys.argv[1], False, backend="nccl", timeout_s=600)[0]
offloaded = run_ranks(steps, Layout(), sys.argv[1], True, backend="nccl", timeout_s=600)[0]
print("on device:", on_device)
print("offloaded:", offloaded)
assert offloaded[2] == ["cpu"] and on_device[2] == ["cuda"], (on_device[2], offloaded[2])
for a, b in zip(on_device[0] + on_device[1], offloaded[0] + offloaded[1]):
    assert abs(a - b) <= 2e-2 * abs(a), (a, b)  # bfloat16 weights; fp32 Adam on either side
print(f"smoke: Adam state in host memory, losses {offloaded[0]} against {on_device[0]} on the device")
EOF

cat >"$WORK/metrics_check.py" <<'EOF'
import sys

from megarl.metrics.sink import read_metrics

run, what = sys.argv[1], sys.argv[2]
rows = [r for r in read_metrics(run) if "reward/mean" in r]
assert rows, f"no RL rows in {run}/metrics.jsonl"
for r in rows:
    assert "sync/failed" not in r and r["sync/version"] == r["step"], r
    print({k: r.get(k) for k in ("step", "reward/mean", "mismatch/logprob_abs_diff", "sync/seconds", "sync/bytes",
                                 "colocate/release_skipped", "colocate/pause_s", "colocate/resume_s")})
first = rows[0]
assert first["mismatch/logprob_abs_diff"] < 1e-2, first  # step 1 trains on the synced start weights
if what == "colocated":
    released = "released" if first["colocate/release_skipped"] == 0 else "release SKIPPED (no memory saver)"
    print(f"smoke: {len(rows)} colocated steps, engines {released}, pause {first['colocate/pause_s']:.2f} s, "
          f"resume {first['colocate/resume_s']:.2f} s")
else:
    print(f"smoke: {len(rows)} steps synced via {what}, {first['sync/bytes'] / 1e6:.1f} MB in {first['sync/seconds']:.2f} s")
EOF

cat >"$WORK/memory_release.py" <<'EOF'
import asyncio
import sys

import torch

from megarl.engines.client import PauseMode, SamplingParams, SGLangClient
from megarl.engines.server import EngineSettings, SGLangEngine

checkpoint, log_path = sys.argv[1], sys.argv[2]
engine = SGLangEngine(EngineSettings(model_path=checkpoint, dtype="float32", device="cuda", log_path=log_path,
                                     extra_args=("--enable-memory-saver", "--mem-fraction-static", "0.3")))
engine.start()
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, top_k=1)


def free_gib():
    return torch.cuda.mem_get_info(0)[0] / 2**30


async def main():
    async with SGLangClient(engine.url, engine.model) as c:
        assert await c.memory_saver_enabled(), "the engine does not report enable_memory_saver"
        before = await c.generate([1, 2, 3, 4], GREEDY, return_routed_experts=False, return_sampling_mask=False)
        f0 = free_gib()
        await c.pause_generation(PauseMode.RETRACT)  # idle, and the scheduler knows it is paused
        await c.release_memory(("kv_cache", "weights"))
        f1 = free_gib()
        await c.resume_memory(("weights",))
        await c.resume_memory(("kv_cache",))
        f2 = free_gib()
        await c.update_weights_from_disk(checkpoint, version=1)  # released weights come back uninitialised
        await c.continue_generation()
        after = await c.generate([1, 2, 3, 4], GREEDY, return_routed_experts=False, return_sampling_mask=False)
    print(f"free GiB: {f0:.2f} -> released {f1:.2f} -> resumed {f2:.2f}; outputs {before.response_ids} / {after.response_ids}")
    assert f1 - f0 > 0.5, "release freed less than 0.5 GiB"
    assert f1 - f2 > 0.5, "resume took less than 0.5 GiB back"
    assert after.response_ids == before.response_ids, "greedy output changed after release + reload"
    print(f"smoke: released {f1 - f0:.1f} GiB, resumed {f1 - f2:.1f} GiB, same greedy output after reloading")


try:
    asyncio.run(main())
finally:
    engine.stop()
EOF

cat >"$WORK/engine_tp2.py" <<'EOF'
import asyncio
import sys

from megarl.engines.client import SamplingParams, SGLangClient
from megarl.engines.server import EngineSettings, SGLangEngine

checkpoint, log_path = sys.argv[1], sys.argv[2]
engine = SGLangEngine(EngineSettings(model_path=checkpoint, dtype="float32", device="cuda", log_path=log_path,
                                     sampling_mask_max_tokens=20, tp=2))
engine.start()


async def main():
    async with SGLangClient(engine.url, engine.model) as c:
        s = await c.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=4, top_k=20))
    assert s.routed_experts is not None and s.routed_experts.shape[0] == 4 + len(s.response_ids) - 1
    assert s.sampling_mask is not None and len(s.rollout_logprobs) == len(s.response_ids)
    print(f"smoke: TP2 engine generated {len(s.response_ids)} tokens with routing {s.routed_experts.shape}")


try:
    asyncio.run(main())
finally:
    engine.stop()
EOF

# rl_run.sh NAME OVERRIDES...: a 2-step sync RL run of the tiny model on the GPUs, then its metrics checked
cat >"$WORK/rl_run.sh" <<'EOF'
set -euo pipefail
name="$1"
shift
"$PY" -m megarl.train recipe=tiny_moe_cpu "model.hf_path=$BASE" "warmup.save_hf_path=$WARM" warmup.steps=20 \
  parallel.backend=nccl mode=sync steps=2 rollout.prompts_per_step=8 rollout.samples_per_prompt=4 \
  "logging.run_dir=$WORK/run_$name" "$@"
"$PY" "$WORK/metrics_check.py" "$WORK/run_$name" "$name"
EOF

# --- the checks ----------------------------------------------------------------------------------
export PY WORK BASE="$WORK/tiny_base" WARM="$WORK/tiny_warm"
if ! "$PY" -c "import sys; from megarl.models.tiny_moe import make_tiny_moe; make_tiny_moe(sys.argv[1])" "$BASE" \
    >"$WORK/setup.log" 2>&1; then
  tail -n 25 "$WORK/setup.log"
  echo "gpu_smoke: FAILED to build the tiny checkpoint (log $WORK/setup.log); nothing else was run"
  exit 1
fi
TRAIN=("$PY" -m megarl.train recipe=tiny_moe_cpu "model.hf_path=$BASE" warmup.steps=20 parallel.backend=nccl)

ranks=1
[ "$gpus" -ge 2 ] && ranks=2
check nccl_group "" "$PY" "$WORK/nccl_group.py" "$ranks"

te_skip=""
has_module transformer_engine || te_skip="transformer_engine is not installed"
check te_layers "$te_skip" "${TRAIN[@]}" mode=warmup model.transformer_impl=transformer_engine \
  "warmup.save_hf_path=$WORK/te_warm" "logging.run_dir=$WORK/te_run"

check sync_nccl "" bash "$WORK/rl_run.sh" distributed placement=disaggregated sync.transport=distributed
check sync_cuda_ipc "" bash "$WORK/rl_run.sh" tensor placement=disaggregated sync.transport=tensor

saver_skip=""
has_module torch_memory_saver || saver_skip="torch_memory_saver is not installed (pip install torch-memory-saver)"
check memory_release "$saver_skip" "$PY" "$WORK/memory_release.py" "$BASE" "$WORK/memory_release_server.log"
# The colocated run runs without torch_memory_saver too (release skipped, which the check reports).
check colocated_run "" bash "$WORK/rl_run.sh" colocated placement=colocated sync.transport=tensor

tp2_skip=""
[ "$gpus" -ge 2 ] || tp2_skip="one GPU only"
check engine_tp2 "$tp2_skip" "$PY" "$WORK/engine_tp2.py" "$BASE" "$WORK/engine_tp2_server.log"

check optimizer_offload "" "$PY" "$WORK/optimizer_offload.py" "$BASE"

echo
echo "gpu_smoke: summary ($gpus GPU(s))"
printf '  %s\n' "${REPORT[@]}"
if [ "$failed" -ne 0 ]; then
  echo "gpu_smoke: FAILED (logs in $WORK)"
  exit 1
fi
echo "gpu_smoke: every check that could run passed"
