"""A driver killed with SIGKILL takes its run's processes with it: the engine and trainer-rank actors
(Ray ends a dead driver's actors), the SGLang servers they started and those servers' children, all
gone within 10 s; with the driver joined to a running Ray (SLURM's ``RAY_ADDRESS``) and with a Ray
the driver started itself (its processes end with it)."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray

pytestmark = pytest.mark.usefixtures("ray_local")  # the driver joins the test process's Ray (conftest)

GONE_WITHIN_S = 10.0
# Ray's own daemons of a Ray the driver started: they end with it on their own schedule (its agents
# outlive it by more than 10 s); they hold no GPU and are not megarl's or SGLang's processes
RAY_DAEMONS = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "dashboard.py",
               "log_monitor.py", "monitor.py")


def _servers(model: Path) -> list[psutil.Process]:
    """The SGLang server processes serving ``model`` (its path is on their command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "megarl.engine_process.sglang_main" in cmdline and str(model) in cmdline:
            found.append(proc)
    return found


def _run_processes(driver: psutil.Process, model: Path, joined: bool) -> list[psutil.Process]:
    """The run's processes: the driver's descendants (its own Ray's, when it started one), the actors
    of jobs other than this process's when it joined this process's Ray (the driver's: this test
    process's Ray serves one test at a time), the SGLang servers of ``model``, and their descendants;
    Ray's own daemons left out."""
    from ray._private.state import actors

    own_job = ray.get_runtime_context().get_job_id()
    roots = [psutil.Process(info["Pid"]) for info in actors().values()
             if joined and info["State"] == "ALIVE" and info["JobID"] != own_job and info["Pid"]]
    roots += [driver, *_servers(model)]
    found = {p.pid: p for p in roots}
    for root in roots:
        found.update((child.pid, child) for child in root.children(recursive=True))
    found.pop(driver.pid)
    return [p for p in found.values() if not any(daemon in _describe(p) for daemon in RAY_DAEMONS)]


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:160]}"
    except psutil.Error:
        return str(proc.pid)


@pytest.mark.parametrize("joined", [True, False], ids=["joined_ray", "own_ray"])
def test_a_killed_driver_leaves_no_process_behind(tmp_path, tiny_checkpoint, joined):
    model = tmp_path / "base"
    shutil.copytree(tiny_checkpoint, model)  # this run's servers: those serving a model path of its own
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    if joined:
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "megarl.train", "recipe=tiny_moe_cpu", "steps=50", "warmup.steps=0",
               "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", f"model.hf_path={model}",
               f"logging.run_dir={tmp_path / 'run'}"]
    driver_log = tmp_path / "driver.log"
    with open(driver_log, "ab") as out:
        driver = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 400
        while "engines healthy at" not in driver_log.read_text() and time.monotonic() < deadline:
            assert driver.poll() is None, driver_log.read_text()[-3000:]
            time.sleep(0.2)
        processes = _run_processes(psutil.Process(driver.pid), model, joined)
        kinds = " ".join(_describe(p) for p in processes)
        assert "EngineActor" in kinds and "TrainerRank" in kinds and "sglang_main" in kinds, kinds
        driver.kill()
        killed_at = time.monotonic()
        _, alive = psutil.wait_procs(processes, timeout=GONE_WITHIN_S)
        took = time.monotonic() - killed_at
    finally:
        driver.kill()
        driver.wait()
    assert not alive, (f"{len(alive)} of the run's {len(processes)} processes outlived the killed driver by "
                       f"{GONE_WITHIN_S:.0f} s:\n" + "\n".join(map(_describe, alive)))
    print(f"{len(processes)} processes gone {took:.1f} s after the kill")
