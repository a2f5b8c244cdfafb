"""slurm/megarl.sbatch under fake sbatch/srun/scontrol (tests/fake_slurm/): a real 2-node Ray
cluster on localhost, overrides passed to the driver, SIGTERM -> checkpoint -> requeue, and
shellcheck. The driver is tests/fake_slurm/train_stub.py (named by MEGARL_TRAIN_CMD) until
``megarl.train`` exists."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fake_slurm"
SBATCH = ROOT / "slurm" / "megarl.sbatch"
NODES, GPUS_PER_NODE = 2, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
def job(tmp_path):
    """Environment of one fake job; afterwards asserts no Ray process of it is left (killing any)."""
    job_id = str(random.randrange(100000, 999999))
    ray_tmp = f"/tmp/mrl_{job_id}"  # short: Ray's unix socket paths must stay under 107 bytes
    out = tmp_path / "stub"
    out.mkdir()
    env = dict(
        os.environ,
        PATH=f"{FAKE}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        FAKE_SLURM_JOB_ID=job_id, FAKE_SLURM_LOG=str(tmp_path / "slurm_calls.log"),
        MEGARL_ROOT=str(ROOT), MEGARL_PYTHON=sys.executable, MEGARL_LOG_DIR=str(tmp_path / "logs"),
        MEGARL_TRAIN_CMD=f"{sys.executable} {FAKE / 'train_stub.py'}", MEGARL_RAY_PORT=str(_free_port()),
        MEGARL_RAY_TEMP_DIR=ray_tmp, MEGARL_RAY_ARGS="--object-store-memory=100000000", MEGARL_RAY_WAIT_S="150",
        RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", STUB_OUT=str(out),
    )
    yield {"env": env, "id": job_id, "out": out, "tmp": tmp_path}
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


def test_ray_cluster_forms_and_overrides_reach_the_driver(job):
    proc = _sbatch(job, "recipe=tiny_moe_cpu", "trainer.lr=0.25", "run_name=from_sbatch")
    output = _finish(proc, timeout=240)
    assert proc.returncode == 0, output
    seen = json.loads((job["out"] / "seen.json").read_text())
    assert seen["argv"] == ["recipe=tiny_moe_cpu", "trainer.lr=0.25", "run_name=from_sbatch"]
    assert (seen["lr"], seen["run_name"]) == (0.25, "from_sbatch")
    assert seen["nodes"] == NODES and seen["gpus"] == NODES * GPUS_PER_NODE
    assert sorted(seen["ran_on"]) == sorted(seen["node_ids"])  # one task ran on each node
    assert seen["node_ips"] == ["127.0.0.1"]
    env = seen["env"]
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["MEGARL_NUM_NODES"] == str(NODES)
    log_dir = Path(env["MEGARL_LOG_DIR"])
    assert log_dir == job["tmp"] / "logs" / f"megarl-{job['id']}" / "restart-0"
    assert {p.name for p in log_dir.iterdir()} >= {"ray-head.log", "ray-worker-1-localhost.log", "train.log", "env.txt"}
    calls = (job["tmp"] / "slurm_calls.log").read_text()
    assert calls.count("srun ") == NODES and "requeue" not in calls


def test_sigterm_checkpoints_and_requeues(job):
    job["env"]["STUB_HOLD"] = "1"
    proc = _sbatch(job, "recipe=tiny_moe_cpu")
    deadline = time.monotonic() + 240
    while not (job["out"] / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the driver never became ready:\n{_finish(proc, timeout=30)}")
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)  # what SLURM sends the batch shell
    output = _finish(proc, timeout=90)
    assert proc.returncode == 0, output
    assert json.loads((job["out"] / "checkpoint.json").read_text()) == {"signal": "SIGTERM"}
    assert f"scontrol requeue {job['id']}" in (job["tmp"] / "slurm_calls.log").read_text()


def test_missing_recipe_is_refused(job):
    proc = _sbatch(job, "trainer.lr=0.1")
    output = _finish(proc, timeout=30)
    assert proc.returncode == 1 and "no recipe: pass recipe=NAME" in output


SHELL_SCRIPTS = [SBATCH, ROOT / "slurm" / "submit.sh", FAKE / "sbatch", FAKE / "srun", FAKE / "scontrol"]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_are_shellcheck_clean():
    result = subprocess.run(["shellcheck", "-x", *map(str, SHELL_SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
