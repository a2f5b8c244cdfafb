"""A driver killed with SIGKILL takes its run's processes with it: the engine and trainer-rank actors
(Ray ends a dead driver's actors), the SGLang servers they started and those servers' children, all
gone within 10 s, with a Ray the driver started itself (its processes end with it). A driver joined to a
running Ray (SLURM's ``RAY_ADDRESS``) is killed mid-run and checked the same way by the resume tests
(tests/resume_runs.py)."""
import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest
from run_processes import assert_gone_after_kill, run_processes


@pytest.mark.processes
def test_a_killed_driver_with_its_own_ray_leaves_no_process_behind(tmp_path, tiny_checkpoint):
    model = tmp_path / "base"
    shutil.copytree(tiny_checkpoint, model)  # this run's servers: those serving a model path of its own
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
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
        run = run_processes(psutil.Process(driver.pid), model, joined=False)
        assert all(kind in run.described for kind in ("EngineActor", "TrainerRank", "sglang_main")), run.described
        driver.kill()
        took = assert_gone_after_kill(run)
    finally:
        driver.kill()
        driver.wait()
    print(f"{len(run.processes)} processes gone {took:.1f} s after the kill")
