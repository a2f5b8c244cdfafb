"""A Ray cluster over fake nodes (:mod:`megarl.rehearsal.fake_nodes`): the head on node 0, a worker on each
other node, each one ``ray start --block`` run in its node as ``slurm/megarl.sbatch`` starts them, with the
CPUs, GPUs and custom resources asked. A node declares GPUs it does not have (``--num-gpus``): Ray then
places GPU work and sets ``CUDA_VISIBLE_DEVICES`` as on a GPU node, which is what the placement rehearsal
checks.

The nodes join one after the other (``slurm/wait_for_ray.py`` waits for each): they share the file system,
and two raylets starting at once in the one session directory can pick the same socket name.
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
        self.temp_dir = f"/tmp/mrl_ray_{os.getpid()}_{nodes.bridge[-2:]}"  # short: socket paths stay < 107 bytes
        self.address = f"{nodes[0].address}:{RAY_PORT}"
        self.processes: dict[int, subprocess.Popen] = {}

    def start(self, index: int, timeout_s: float = 180.0) -> None:
        """Start node ``index``'s raylet (the head for node 0) and wait until the cluster has every started
        node alive; RuntimeError with the node's log when it does not join within ``timeout_s``."""
        node = self.nodes[index]
        where = (["--head", f"--port={RAY_PORT}", "--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
                 if index == 0 else [f"--address={self.address}"])
        argv = [str(Path(sys.executable).parent / "ray"), "start", *where, f"--node-ip-address={node.address}",
                f"--num-cpus={self.num_cpus}", f"--num-gpus={self.num_gpus}",
                f"--resources={json.dumps(dict(self.resources.get(index, {})))}", "--object-store-memory=100000000",
                "--disable-usage-stats", "--include-log-monitor=false", "--block"]
        log_path = self.log_dir / f"ray-node{index}.log"
        with open(log_path, "a") as log:
            env = node_env(RAY_raylet_start_wait_time_s="120", **self.env)
            self.processes[index] = node.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        ready = self.nodes[0].run(
            [sys.executable, str(WAIT_FOR_RAY), "--address", self.address, "--nodes", str(len(self.processes)),
             "--timeout", str(timeout_s), "--watch", str(self.processes[index].pid)],
            env=node_env(), capture_output=True, text=True, timeout=timeout_s + 60)
        if ready.returncode != 0:
            raise RuntimeError(f"node {index} did not join the Ray cluster: {ready.stdout}{ready.stderr}\n"
                               f"{log_path.read_text(errors='replace')[-3000:]}")

    def start_all(self) -> RayOnNodes:
        """Every node, the head first; what was started is stopped when one fails to join."""
        try:
            for node in self.nodes:
                self.start(node.index)
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
        shutil.rmtree(self.temp_dir, ignore_errors=True)
