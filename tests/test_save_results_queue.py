"""megatron-core's checkpoint-save results queue (megarl/trainer/save_results_queue.py): its Manager server
ends when the process that saves is SIGKILLed, where megatron's own is orphaned and lives on."""
import subprocess
import sys
import time

import psutil
import pytest

OWNER = """
import sys, time
from megatron.core.dist_checkpointing.strategies import filesystem_async
if sys.argv[1].startswith("megarl"):
    from megarl.trainer import save_results_queue
    if sys.argv[1] == "megarl_after_a_save":
        filesystem_async.get_write_results_queue()  # megatron's own, made by an earlier save
    save_results_queue.install()
queue = filesystem_async.get_write_results_queue()  # what a save calls
queue.put("written")
assert queue.get() == "written"
print(queue._manager._process.pid, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def server_after_owner_killed(which: str, wait_s: float) -> bool:
    """Start an owner that makes the queue (``which``: "megarl", "megarl_after_a_save" or megatron's own),
    SIGKILL it, and say whether the queue's Manager server still runs ``wait_s`` later (killed then either way)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, which], stdout=subprocess.PIPE, text=True)
    try:
        server = int(owner.stdout.readline())
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + wait_s
    while running(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = running(server)
    if alive:
        psutil.Process(server).kill()
    return alive


@pytest.mark.parametrize("which, outlives", [("megatron", True), ("megarl", False), ("megarl_after_a_save", False)])
def test_the_queues_server_ends_with_a_killed_owner(which, outlives):
    assert server_after_owner_killed(which, wait_s=3.0) is outlives
