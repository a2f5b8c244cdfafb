"""Stand-in for ``python -m megarl.train`` in the fake-SLURM signal test (the real driver's signal
handling is tested in tests/test_rl_resume.py).

It keeps the driver's contract with slurm/megarl.sbatch: it joins the Ray cluster at RAY_ADDRESS,
takes the recipe and Hydra overrides as arguments, and on SIGTERM/SIGUSR1 writes a checkpoint
and exits 0. What it saw goes to ``$STUB_OUT/seen.json``: the arguments, the composed config's
values, the alive Ray nodes and GPUs, the node each of one task per node ran on, the driver's node
address, the environment the script derived. With STUB_HOLD=1 it then waits (at most STUB_HOLD_S
seconds) for a signal, having written ``$STUB_OUT/ready``; the checkpoint is ``$STUB_OUT/checkpoint.json``.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from megarl.config import load_config

OUT = Path(os.environ["STUB_OUT"])


def checkpoint_and_exit(signum, _frame):
    (OUT / "checkpoint.json").write_text(json.dumps({"signal": signal.Signals(signum).name}))
    sys.exit(0)


@ray.remote(num_cpus=0)
def where() -> str:
    return ray.get_runtime_context().get_node_id()


def main() -> int:
    cfg = load_config(sys.argv[1:])
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    # After ray.init, which installs its own SIGTERM handler (sys.exit(15)) in the driver.
    signal.signal(signal.SIGTERM, checkpoint_and_exit)
    signal.signal(signal.SIGUSR1, checkpoint_and_exit)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    ran_on = ray.get([
        where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ])
    seen = {
        "argv": sys.argv[1:], "run_name": cfg.run_name, "lr": cfg.trainer.lr,
        "nodes": len(nodes), "gpus": sum(n["Resources"].get("GPU", 0) for n in nodes),
        "node_ips": sorted({n["NodeManagerAddress"] for n in nodes}), "ran_on": ran_on,
        "driver_node_ip": ray.util.get_node_ip_address(),
        "node_ids": [n["NodeID"] for n in nodes],
        "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME",
                                                "GLOO_SOCKET_IFNAME", "MEGARL_NUM_NODES", "MEGARL_LOG_DIR")},
    }
    (OUT / "seen.json").write_text(json.dumps(seen))
    if os.environ.get("STUB_HOLD") == "1":
        (OUT / "ready").write_text("ready")
        deadline = time.monotonic() + float(os.environ.get("STUB_HOLD_S", "120"))
        while time.monotonic() < deadline:
            time.sleep(0.2)
        return 3  # no signal came
    return 0


if __name__ == "__main__":
    sys.exit(main())
