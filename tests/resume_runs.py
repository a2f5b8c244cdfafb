"""The async driver killed and resumed, the check shared by tests/test_rl_resume.py (full weights,
the demo) and tests/test_rl_resume_lora.py (LoRA adapters synced alone; two files so that the two
runs can go to different test workers): SIGKILL mid-run (the rerun resumes from the last periodic
checkpoint), then a stop request (checkpoint after the step in progress, exit 0): SIGTERM, a
scheduler's, for the demo, and SIGINT, a terminal's Ctrl-C, for LoRA. Step numbers continue, no
prompt is trained twice in the run's lineage, and the sample ledger carries over. With LoRA the
checkpoints hold adapters only, and the resumed engine gets the checkpoint's adapter before it generates."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import ray
from run_processes import RunProcesses, assert_gone_after_kill, run_processes

from megarl.metrics.sink import read_metrics

STEPS = 8


def command(tmp_path: Path, recipe: str) -> list[str]:
    return [sys.executable, "-m", "megarl.train", f"recipe={recipe}", f"steps={STEPS}", "trainer.save_interval=2",
            "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "warmup.steps=30",
            f"model.hf_path={tmp_path / 'base'}", "model.make_tiny_if_missing=true",
            f"warmup.save_hf_path={tmp_path / 'warm'}",
            f"logging.run_dir={tmp_path / 'run'}"]


def rl_steps(run: Path, since: float = 0.0) -> list[int]:
    """The RL steps in metrics.jsonl (those logged after unix time ``since``)."""
    if not (run / "metrics.jsonl").is_file():
        return []
    return [row["step"] for row in read_metrics(run) if "reward/mean" in row and row["time"] > since]


def engine_processes(tmp_path: Path) -> list[psutil.Process]:
    """SGLang server processes serving this test's checkpoint."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "megarl.engine_process.sglang_main" in cmdline and str(tmp_path / "warm") in cmdline:
            found.append(proc)
    return found


def signal_driver_when(tmp_path: Path, recipe: str, ready: Callable[[], bool],
                       sig: signal.Signals) -> tuple[subprocess.Popen, list[Path], RunProcesses]:
    """Start the driver, send ``sig`` once ``ready()``, wait for it to end; returns it, the temporary
    directories (``TMPDIR``) its SGLang servers had when the signal went, and the run's processes then
    (tests/run_processes.py)."""
    # the driver joins the test process's Ray (tests/conftest.py, ray_local) rather than starting one
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    with open(tmp_path / "driver.log", "ab") as out:
        # SIGINT handled as in a terminal's foreground job, even when the tests run where it is ignored
        # (a background job, nohup): the driver leaves an ignored SIGINT ignored
        proc = subprocess.Popen(command(tmp_path, recipe), stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 400
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"driver ended early (rc {proc.returncode}); see {tmp_path / 'driver.log'}"
        scratch = [Path(p.environ()["TMPDIR"]) for p in engine_processes(tmp_path)]
        at_signal = run_processes(psutil.Process(proc.pid), tmp_path / "warm", joined=True)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    return proc, scratch, at_signal


def run_until(tmp_path: Path, recipe: str, last_step: int,
              sig: signal.Signals) -> tuple[subprocess.Popen, list[Path], RunProcesses]:
    """:func:`signal_driver_when` step ``last_step`` of this driver is in metrics.jsonl."""
    started = time.time()
    return signal_driver_when(tmp_path, recipe,
                              lambda: max(rl_steps(tmp_path / "run", started), default=0) >= last_step, sig)


def copy_warmed_up(tmp_path: Path, warmed_up) -> None:
    """The session's warm-up (tests/conftest.py), copied: this test's servers are those serving
    ``tmp_path / "warm"``."""
    shutil.copytree(warmed_up.base, tmp_path / "base")
    shutil.copytree(warmed_up.warm, tmp_path / "warm")


def check_stop_during_start_up(recipe, tmp_path, warmed_up):
    """SIGTERM while the engine loads: the driver cancels its start-up, stops the engine at once
    (not once it is healthy), writes no checkpoint and exits 0 (a SLURM job then requeues itself)."""
    copy_warmed_up(tmp_path, warmed_up)
    proc, loading, _ = signal_driver_when(tmp_path, recipe, lambda: bool(engine_processes(tmp_path)),
                                          signal.SIGTERM)
    assert loading, (tmp_path / "driver.log").read_text()[-3000:]  # the signal came while an engine ran
    driver_log = (tmp_path / "driver.log").read_text()
    assert proc.returncode == 0, driver_log[-3000:]
    assert "stopped by SIGTERM during start-up" in driver_log, driver_log[-3000:]
    assert "engines healthy at" not in driver_log  # the engine's start was cancelled, not waited for
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()
    assert not engine_processes(tmp_path)


def check_kill_and_resume(recipe, tmp_path, warmed_up, stop: signal.Signals):
    run = tmp_path / "run"
    copy_warmed_up(tmp_path, warmed_up)
    killed, scratch, at_kill = run_until(tmp_path, recipe, 3, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    assert scratch and all(any(path.iterdir()) for path in scratch)  # SGLang's sockets, in the server's TMPDIR
    # the killed driver's run ends with it: its actors (Ray ends a dead driver's), the SGLang server (its own
    # process group, which notices) and the server's children
    assert all(kind in at_kill.described for kind in ("EngineActor", "TrainerRank", "sglang_main")), at_kill.described
    assert_gone_after_kill(at_kill)
    # the periodic checkpoint before the kill (2), or the next one (4): the trainer rank is a Ray actor,
    # which can finish writing a checkpoint it had begun after its driver died
    assert (run / "checkpoints" / "latest").read_text().strip() in ("2", "4")

    # resumes at 3, then the stop request: checkpoint and exit
    terminated, left, _ = run_until(tmp_path, recipe, 4, stop)
    assert terminated.returncode == 0, (tmp_path / "driver.log").read_text()[-3000:]
    # the killed server's TMPDIR went when the next server started, the stopped one's with its stop()
    assert left and not any(path.exists() for path in scratch + left), "a server's TMPDIR is left"
    stopped_at = int((run / "checkpoints" / "latest").read_text())
    assert 4 <= stopped_at <= STEPS
    assert rl_steps(run) == list(range(1, stopped_at + 1))  # the killed run's steps after its checkpoint were replaced
    log = [json.loads(line) for line in (run / "trained_prompts.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == list(range(1, stopped_at + 1))
    trained = [i for row in log for i in row["prompts"]]
    assert all(len(row["prompts"]) == 4 for row in log) and len(set(trained)) == len(trained)
    last = [row for row in read_metrics(run) if "reward/mean" in row][-1]
    assert last["buffer/prompts_trained"] == 4 * stopped_at  # the ledger carried over the restart
    assert last["buffer/trained"] + last["buffer/error"] <= last["buffer/samples_started"]
    driver_log = (tmp_path / "driver.log").read_text()
    resumed = re.search(r"resuming at step (\d+)", driver_log)
    assert resumed and int(resumed.group(1)) in (2, 4), driver_log[-3000:]
    assert f"stopped by {stop.name} after step {stopped_at}" in driver_log
    if recipe == "tiny_moe_lora_cpu":
        from torch.distributed.checkpoint import FileSystemReader

        from megarl.trainer.checkpoint import step_dir

        keys = FileSystemReader(str(step_dir(run / "checkpoints", stopped_at))).read_metadata().state_dict_metadata
        weights = [k for k in keys if not k.startswith(("optimizer.", "rng_state", "common_state"))]
        assert weights and all(".adapter." in k for k in weights), weights[:5]
        assert f"adapters of version {resumed.group(1)} synced" in driver_log  # before the resumed run generates
