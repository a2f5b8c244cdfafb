"""GPU smoke test: the GPU paths the CPU suite cannot run, ordered by risk, each in a process of its own
with a time limit, stopping at the first failure; one JSON object on stdout.

Steps (``STEPS``; a step whose packages or GPUs are missing is skipped with the reason):
  env               versions, the platform description megarl derives its GPU decisions from
  sft               one NCCL rank, the tiny MoE in bfloat16: supervised steps packed (THD) and padded
  rl_replay         RL steps with Keep Routing and Keep Sampling Mask on HF-sampled routes and masks:
                    float32 reproduces HF's log-probs, bfloat16 stays near them
  optimizer_offload megatron-core's HybridDeviceOptimizer (Adam state in host memory) against the
                    on-device optimizer over three bfloat16 steps
  te_layers         the sft and rl_replay checks with transformer-engine layers
  engine_memory     one bfloat16 SGLang engine with the memory saver: release, resume, same greedy output
  colocated_run     a two-step colocated RL run (CUDA IPC weight sync, engines released around training)

usage: tools/gpu_smoke.sh [--plan] [--fetch DIR] [--carry DIR] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a machine with torch alone (the lent H200's image) lacks for the trainer steps (megarl.config
# imports the engines' client, hence pybase64): exact versions of requirements.lock; antlr4 4.9.3 exists
# only as an sdist, so --fetch builds its (pure Python) wheel.
CARRIED = ("megatron-core==0.19.2", "megatron-bridge==0.6.2", "omegaconf==2.3.1", "hydra-core==1.3.8",
           "pybase64==1.5.1", "antlr4-python3-runtime==4.9.3")


@dataclass(frozen=True)
class Step:
    name: str
    planned_s: int
    needs: tuple[str, ...] = ()  # importable modules
    gpus: int = 1


STEPS = (
    Step("env", 20),
    Step("sft", 60, ("megatron.core", "megatron.bridge")),
    Step("rl_replay", 90, ("megatron.core", "megatron.bridge")),
    Step("optimizer_offload", 60, ("megatron.core", "megatron.bridge")),
    Step("te_layers", 90, ("megatron.core", "megatron.bridge", "transformer_engine.pytorch")),
    Step("engine_memory", 120, ("sglang", "sgl_kernel", "torch_memory_saver")),
    Step("colocated_run", 150, ("sglang", "sgl_kernel", "torch_memory_saver", "ray", "transformer_engine.pytorch")),
)
LIMIT_S = 600  # the machine a session may be lent: one GPU for 10 minutes


def missing(step: Step) -> str | None:
    """Why ``step`` cannot run here, or None."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.device_count() < step.gpus:
        return f"needs {step.gpus} GPUs, {torch.cuda.device_count()} here"
    for module in step.needs:
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        except ModuleNotFoundError:
            return f"{module} is not installed"
    return None


def carried_files(carry: Path) -> list[Path]:
    return sorted(p for p in carry.rglob("*") if p.is_file()) if carry.is_dir() else []


def plan(carry: Path) -> dict:
    files = carried_files(carry)
    return {"carry_dir": str(carry), "carry_bytes": sum(p.stat().st_size for p in files),
            "carried": [str(p.relative_to(carry)) for p in files], "packages": list(CARRIED),
            "steps": [{"name": s.name, "planned_seconds": s.planned_s, "needs": list(s.needs), "gpus": s.gpus}
                      for s in STEPS],
            "planned_seconds": sum(s.planned_s for s in STEPS)}


def fetch(carry: Path) -> None:
    """Wheels of :data:`CARRIED` for CPython 3.12 on x86-64 Linux, and the tiny MoE checkpoint, into ``carry``."""
    wheels = carry / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    binary = [p for p in CARRIED if not p.startswith("antlr4")]
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
                    "manylinux_2_17_x86_64", "-d", str(wheels), *binary], check=True)
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(wheels),
                    next(p for p in CARRIED if p.startswith("antlr4"))], check=True)
    from megarl.models.tiny_moe import make_tiny_moe

    make_tiny_moe(str(carry / "tiny_moe"))


def run_steps(carry: Path, timeout_scale: float) -> dict:
    results, failed = [], False
    for step in STEPS:
        why = missing(step)
        if failed or why:
            results.append({"name": step.name, "status": "skipped", "reason": "an earlier step failed" if failed
                            else why})
            continue
        t0 = time.monotonic()
        cmd = [sys.executable, str(ROOT / "tools" / "gpu_smoke_steps.py"), step.name, str(carry / "tiny_moe")]
        try:
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                 timeout=step.planned_s * timeout_scale, env=os.environ)
            status, stdout = ("ok" if out.returncode == 0 else "failed"), out.stdout
            tail = (out.stdout + out.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            stdout = (exc.stdout or b"").decode(errors="replace")
            status, tail = "failed", f"timed out after {exc.timeout:.0f} s: {stdout[-2000:]}"
        seconds = round(time.monotonic() - t0, 1)
        result = {"name": step.name, "status": status, "seconds": seconds}
        lines = [line for line in stdout.splitlines() if line.startswith("smoke: ")]
        if status == "ok" and lines:
            result["result"] = json.loads(lines[-1][len("smoke: "):])
        else:
            result["log_tail"] = tail
            failed = status == "failed"
        results.append(result)
    return {"ok": not failed, "steps": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true",
                        help="print what would be carried (fetched first if absent) and run, as JSON")
    parser.add_argument("--fetch", action="store_true", help="download the carried wheels and build the checkpoint")
    parser.add_argument("--carry", type=Path, default=ROOT / ".gpu_smoke", help="the carried files' directory")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--timeout-scale", type=float, default=1.5, help="a step's limit: its planned seconds x this")
    args = parser.parse_args()
    if args.fetch:
        fetch(args.carry)
    if args.plan and not (args.carry / "tiny_moe" / "config.json").is_file():
        fetch(args.carry)
    report = plan(args.carry) if args.plan or args.fetch else run_steps(args.carry, args.timeout_scale)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if report.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
