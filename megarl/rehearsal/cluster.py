"""The rehearsal's cluster: ``MAX_NODES`` fake nodes (:mod:`megarl.rehearsal.fake_nodes`) of ``NODE_GPUS``
declared GPUs each under one Ray (:mod:`megarl.rehearsal.ray_nodes`), and the driver run in node 0.
Needs root and iproute2 (network namespaces)."""
from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from megarl.rehearsal.fake_nodes import FakeNodes, missing_prerequisite
from megarl.rehearsal.ray_nodes import ROOT, RayOnNodes, node_env
from megarl.rehearsal.scale import MAX_NODES, NODE_GPUS

NODE_CPUS = 4  # logical CPUs a fake node declares: its trainer ranks' (1 each) and engines' (0.5 each)
DRIVER = [sys.executable, "-m", "megarl.rehearsal.driver"]
REPORT_PREFIX = "REHEARSAL-REPORT "  # the driver's line of one recipe's report (JSON follows)


class RehearsalUnavailable(RuntimeError):
    """Fake nodes cannot be made on this machine (no root, no iproute2)."""


@contextlib.contextmanager
def gpu_cluster(log_dir: Path) -> Iterator[RayOnNodes]:
    """The rehearsal's Ray cluster while the block runs (its nodes' logs in ``log_dir``); torn down after."""
    missing = missing_prerequisite()
    if missing is not None:
        raise RehearsalUnavailable(f"the placement rehearsal brings up fake nodes: {missing}")
    log_dir.mkdir(parents=True, exist_ok=True)
    with FakeNodes(MAX_NODES) as nodes:
        cluster = RayOnNodes(nodes, log_dir, num_cpus=NODE_CPUS, num_gpus=NODE_GPUS).start_all()
        try:
            yield cluster
        finally:
            cluster.stop()


def run_driver(cluster: RayOnNodes, work: Path, recipes: Sequence[str], overrides: Sequence[str] = (),
               driver: Sequence[str] = DRIVER, timeout_s: float = 600.0) -> tuple[list[dict], str]:
    """Run the rehearsal's driver (``driver``: its command) for ``recipes`` with ``overrides`` in node 0 of
    ``cluster``, writing under ``work``; the reports it printed (one a recipe, in order, and any a driver of
    its own prints after them) and its output."""
    work.mkdir(parents=True, exist_ok=True)
    argv = [*driver, str(work), *recipes, "--", *overrides]
    result = cluster.nodes[0].run(argv, env=node_env(RAY_ADDRESS=cluster.address), cwd=ROOT, capture_output=True,
                                  text=True, timeout=timeout_s)
    output = result.stdout + result.stderr
    reports = [json.loads(line[len(REPORT_PREFIX):]) for line in result.stdout.splitlines()
               if line.startswith(REPORT_PREFIX)]
    if result.returncode != 0 or len(reports) < len(recipes):
        raise RuntimeError(f"the rehearsal's driver failed (exit {result.returncode}):\n{output[-6000:]}")
    return reports, output


def rehearse(recipes: Sequence[str], overrides: Sequence[str] = ()) -> list[dict]:
    """Each recipe's report (:mod:`megarl.rehearsal.driver`), rehearsed on one fresh cluster."""
    with tempfile.TemporaryDirectory(prefix="megarl-rehearsal-") as tmp:
        with gpu_cluster(Path(tmp) / "ray") as cluster:
            return run_driver(cluster, Path(tmp) / "work", recipes, overrides)[0]
