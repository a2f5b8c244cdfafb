"""Wait until a Ray cluster has the expected nodes and GPUs alive; used by megarl.sbatch.

    python slurm/wait_for_ray.py --address HEAD_IP:PORT --nodes N --gpus G [--timeout SECONDS] [--watch PID ...]

Exit 0 once at least N nodes and G GPUs are alive; 1 (with what joined) when the timeout passes or
a watched process (the `srun ... ray start --block` steps) has exited, since the cluster cannot
form then.
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
import time

log = logging.getLogger("wait_for_ray")
POLL_S = 0.5  # between two reads of the alive nodes (one GCS call each)
LOG_EVERY_S = 5.0  # at most one "not reachable yet" line in this time


def alive(nodes: list[dict]) -> tuple[int, float]:
    """(alive nodes, their GPUs) from ``ray.nodes()``."""
    up = [n for n in nodes if n.get("Alive")]
    return len(up), sum(n.get("Resources", {}).get("GPU", 0.0) for n in up)


def exited(pid: int) -> bool:
    """True when ``pid`` is gone or a zombie (exited, not yet reaped by its parent)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[wait_for_ray] %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="HEAD_IP:PORT of the Ray head")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--watch", type=int, nargs="*", default=[], help="pids that must stay alive")
    args = parser.parse_args()

    import ray

    deadline = time.monotonic() + args.timeout
    nodes, gpus, last_log = 0, 0.0, -LOG_EVERY_S
    while time.monotonic() < deadline:
        gone = [pid for pid in args.watch if exited(pid)]
        if gone:
            log.error("a ray start step exited (pid %s): the cluster cannot form", ", ".join(map(str, gone)))
            return 1
        try:
            if not ray.is_initialized():
                host, port = args.address.rsplit(":", 1)
                socket.create_connection((host, int(port)), timeout=2.0).close()  # ray.init would block
                ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
            nodes, gpus = alive(ray.nodes())
        except (OSError, RuntimeError) as exc:  # the head is not up yet
            if time.monotonic() - last_log >= LOG_EVERY_S:
                log.info("head %s not reachable yet (%s)", args.address, type(exc).__name__)
                last_log = time.monotonic()
        if nodes >= args.nodes and gpus >= args.gpus:
            log.info("ray cluster ready: %d/%d nodes, %g/%d GPUs", nodes, args.nodes, gpus, args.gpus)
            return 0
        time.sleep(POLL_S)
    log.error("timeout after %.0f s: %d/%d nodes, %g/%d GPUs joined", args.timeout, nodes, args.nodes, gpus, args.gpus)
    return 1


if __name__ == "__main__":
    sys.exit(main())
