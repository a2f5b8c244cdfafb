"""What megarl starts ends with whatever started it, killed with SIGKILL: a child made with
``die_with_parent`` (the fake nodes' processes), a driver naming its owner in ``MEGARL_END_WITH_PID``
through a shell in between (a test worker's drivers), and ``python -m megarl.train`` watches its owner
before anything else."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megarl.lifetime import OWNER_ENV

pytestmark = pytest.mark.processes

GONE_WITHIN_S = 5.0
WATCHED = "from megarl.lifetime import end_with_owner_from_env as e; e(); import time; time.sleep(600)"
# A stand-in test worker: names itself the owner, starts a driver through a shell and a child the kernel
# ends with it, prints their pids and waits to be killed.
WORKER = f"""
import json, os, subprocess, sys, time
from megarl.lifetime import OWNER_ENV, die_with_parent
os.environ[OWNER_ENV] = str(os.getpid())
shell = subprocess.Popen(["sh", "-c", 'exec "$0" -c "$1"', sys.executable, {WATCHED!r}])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=die_with_parent)
print(json.dumps([shell.pid, child.pid]), flush=True)
time.sleep(600)
"""


def test_a_killed_worker_takes_its_drivers_and_children_with_it():
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(worker.stdout.readline())
        started = [psutil.Process(pid) for pid in pids]
        time.sleep(1.0)  # the driver's watch is up once it imported megarl.lifetime
        assert all(p.is_running() for p in started)
        worker.kill()
        killed_at = time.monotonic()
        _, alive = psutil.wait_procs(started, timeout=GONE_WITHIN_S)
        took = time.monotonic() - killed_at
    finally:
        worker.kill()
        worker.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, NameError):
                pass
    assert not alive, f"{[p.pid for p in alive]} outlived the killed worker by {GONE_WITHIN_S:g} s"
    assert took < GONE_WITHIN_S


def test_the_driver_watches_its_owner_first():
    gone = subprocess.Popen(["true"])
    gone.wait()
    env = {**os.environ, OWNER_ENV: str(gone.pid)}
    driver = subprocess.run([sys.executable, "-m", "megarl.train", "recipe=tiny_moe_cpu", "--cfg", "job"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert driver.returncode == -signal.SIGKILL and "that process is gone" in driver.stderr, driver.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", "from megarl.lifetime import end_with_owner_from_env as e; e()"],
                         env={**os.environ, OWNER_ENV: "12x"}, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "MEGARL_END_WITH_PID='12x': not a process id" in bad.stderr
