"""megatron-core's checkpoint-save results queue (megarl/trainer/save_results_queue.py): megarl's synchronous
saves report through an in-process queue and start no process, where megatron's own queue starts a
Manager server (~750 MB, orphaned when the rank is SIGKILLed)."""
import os
import sys

import fresh_python
import pytest

pytestmark = pytest.mark.processes

# A save in a fresh gloo process of one rank: megatron-core's torch_dist save of one sharded tensor,
# loaded back; prints the processes the save left running under this one, and whether it equals.
SAVE = """
import os, sys, tempfile
import psutil, torch
from megarl.platform import megatron_cpu
megatron_cpu.apply()
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
if sys.argv[1] == "megarl":
    from megarl.trainer import save_results_queue
    save_results_queue.install()
weight = torch.arange(12, dtype=torch.float32).view(3, 4)
state = {"w": ShardedTensor.from_rank_offsets("w", weight)}
with tempfile.TemporaryDirectory() as path:
    dist_checkpointing.save(state, path, sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, path)
children = [p for p in psutil.Process().children(recursive=True) if p.is_running()]
print(len(children), bool(torch.equal(loaded["w"], weight)), flush=True)
"""


@pytest.mark.parametrize("which, starts_processes", [("megatron", True), ("megarl", False)])
def test_a_save_round_trips_and_only_megatrons_queue_starts_a_process(which, starts_processes, tmp_path):
    from megarl.parallel.network import free_port

    # TMPDIR: megatron's Manager server is terminated at exit and leaves its pymp-* directory behind
    done = fresh_python.run([sys.executable, "-c", SAVE, which, str(free_port("127.0.0.1"))], timeout=300,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    started, equal = done.stdout.split()
    # megatron's: its Manager server (and the spawn context's resource tracker); megarl's: none
    assert (int(started) > 0, equal) == (starts_processes, "True")
