"""A Ray cluster over fake nodes (:mod:`megarl.rehearsal.fake_nodes`): the head on node 0, a worker on each
other node, each one ``ray start --block`` run in its node as ``slurm/megarl.sbatch`` starts them, with the
CPUs, GPUs and custom resources asked. A node declares GPUs it does not have (``--num-gpus``): Ray then
places GPU work and sets ``CUDA_VISIBLE_DEVICES`` as on a GPU node, which is what the placement rehearsal
checks.

Each node keeps its Ray session under a temporary directory of its own (``--temp-dir``, which Ray takes per
node): the nodes share the file system, and two raylets starting at once in one session directory can pick
the same socket name. So the other nodes start together once the head is up (``slurm/wait_for_ray.py``
waits for them).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from megarl.rehearsal.fake_nodes import FakeNodes, kill_namespace_processes

RAY_PORT = 6379
ROOT = Path(__file__).resolve().parents[2]
WAIT_FOR_RAY = ROOT / "slurm" / "wait_for_ray.py"
CLUSTER_ADDRESS_VARIABLES = ("RAY_ADDRESS", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def node_env(**extra: str) -> dict[str, str]:
    """The environment of a process in a fake node: this one's without any cluster address, one thread a
    process, this interpreter's directory first on PATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_ADDRESS_VARIABLES}
    env.update(OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra)
    return env


class RayOnNodes:
    """Ray over ``nodes``: ``num_cpus`` CPUs and ``num_gpus`` GPUs a node, ``resources[i]`` the custom
    resources of node ``i`` (none where absent), ``env`` more variables for the raylets (and so for every
    worker they start). Each node's output goes to ``log_dir/ray-node<i>.log``. :meth:`start` a node (the
    head first) and wait until it joined; :meth:`stop` kills every node's processes."""

    def __init__(self, nodes: FakeNodes, log_dir: Path, *, num_cpus: int = 2, num_gpus: int = 0,
                 resources: Mapping[int, Mapping[str, float]] | None = None, env: Mapping[str, str] | None = None):
        self.nodes, self.log_dir = nodes, Path(log_dir)
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.resources, self.env = dict(resources or {}), dict(env or {})
        base = f"/tmp/mrl_ray_{os.getpid()}_{nodes.bridge[-2:]}"  # short: socket paths stay < 107 bytes
        self.temp_dirs = [f"{base}_{node.index}" for node in nodes]
        self.temp_dir = self.temp_dirs[0]  # the head's
        self.address = f"{nodes[0].address}:{RAY_PORT}"
        self.processes: dict[int, subprocess.Popen] = {}

    def start(self, index: int, timeout_s: float = 180.0, wait: bool = True) -> None:
        """Start node ``index``'s raylet (the head for node 0); with ``wait``, wait until every started node
        is alive (:meth:`wait`)."""
        node = self.nodes[index]
        where = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if index == 0 else [
            f"--address={self.address}"]
        argv = [str(Path(sys.executable).parent / "ray"), "start", *where, f"--temp-dir={self.temp_dirs[index]}",
                f"--node-ip-address={node.address}", f"--num-cpus={self.num_cpus}", f"--num-gpus={self.num_gpus}",
                f"--resources={json.dumps(dict(self.resources.get(index, {})))}", "--object-store-memory=100000000",
                "--disable-usage-stats", "--include-log-monitor=false", "--block"]
        with open(self.log_dir / f"ray-node{index}.log", "a") as log:
            env = node_env(RAY_raylet_start_wait_time_s="120", **self.env)
            self.processes[index] = node.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait(timeout_s)

    def wait(self, timeout_s: float = 180.0) -> None:
        """Wait until the cluster has every started node alive; RuntimeError with the nodes' logs when it does
        not within ``timeout_s`` or a node's ``ray start`` exits."""
        ready = self.nodes[0].run(
            [sys.executable, str(WAIT_FOR_RAY), "--address", self.address, "--nodes", str(len(self.processes)),
             "--timeout", str(timeout_s), "--watch", *(str(p.pid) for p in self.processes.values())],
            env=node_env(), capture_output=True, text=True, timeout=timeout_s + 60)
        if ready.returncode != 0:
            logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.log_dir.glob("ray-node*.log")))
            raise RuntimeError(f"the Ray cluster did not form: {ready.stdout}{ready.stderr}\n{logs}")

    def start_all(self) -> RayOnNodes:
        """Every node, the head first, then the others together; what was started is stopped when one fails
        to join."""
        try:
            self.start(0)
            for node in self.nodes.nodes[1:]:
                self.start(node.index, wait=False)
            self.wait()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Every node's processes killed at once (no grace period: some of Ray's processes outlive SIGTERM by
        the whole grace, and a cluster of fake nodes has nothing to shut down cleanly), the session
        directory removed."""
        kill_namespace_processes([node.namespace for node in self.nodes], hard=True)
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.processes.clear()
        for temp_dir in self.temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)
