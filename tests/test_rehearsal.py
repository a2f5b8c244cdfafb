"""The placement rehearsal (megarl/rehearsal/): every recipe of recipes/ written for GPUs started for real on
one cluster of fake GPU nodes (network namespaces whose raylets declare 2 GPUs each), scaled down to at
most 4 nodes with its shape kept, with stand-ins for the trainer ranks' Megatron build and the SGLang
servers; its checks pass (trainer and engine ranks on the planned nodes and GPUs, CUDA IPC senders beside
their receivers, one NCCL environment, absolute paths). A recipe whose engines are put on another node
than the trainer ranks they share is caught. The CPU recipes are not rehearsed: the suite runs them."""
from __future__ import annotations

import pytest

from megarl.config.load import recipes_dir
from megarl.rehearsal.cluster import DRIVER, RehearsalUnavailable, gpu_cluster, run_driver

pytestmark = pytest.mark.processes

RECIPES = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
GPU_RECIPES = {"glm45_355b_a32b", "deepseek_v3_671b", "qwen3_235b_a22b", "qwen3_30b_a3b", "qwen3_30b_a3b_lora"}

# The driver for the recipes given, then for qwen3_30b_a3b once more with the colocated engines' seats moved to a
# node none of their trainer ranks is on (the next alive node of the cluster): the pinning broken, as before
# engines were pinned. One process: the driver's imports are paid once.
MISPLACED = r"""
import asyncio, sys
from pathlib import Path
import ray
from megarl.parallel.places import Place
from megarl.rehearsal import driver
import megarl.pipeline.startup.engines as engines

pinned = engines.colocated_seats

def elsewhere(places, engine, engine_tp, nnodes):
    seats = pinned(places, engine, engine_tp, nnodes)
    nodes = sorted((n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes() if n["Alive"])
    ids = [n for n, _ in nodes]
    moved = [nodes[(ids.index(s.node_id) + 1) % len(nodes)] for s in seats]
    return [Place(node_id, address, s.gpus) for (node_id, address), s in zip(moved, seats)]

work, recipes = Path(sys.argv[1]), sys.argv[2:sys.argv.index("--")]
asyncio.run(driver.main(work, recipes, []))
engines.colocated_seats = elsewhere
asyncio.run(driver.main(work / "misplaced", ["qwen3_30b_a3b"], []))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The rehearsal's cluster, shared by the module (without root or iproute2 its tests fail, saying why)."""
    try:
        with gpu_cluster(tmp_path_factory.mktemp("rehearsal_ray")) as up:
            yield up
    except RehearsalUnavailable as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def rehearsed(cluster, tmp_path_factory) -> list[dict]:
    """Every recipe's report, then the misplaced run's (``MISPLACED``), from one run of the driver."""
    found, output = run_driver(cluster, tmp_path_factory.mktemp("rehearsal"), RECIPES,
                               driver=[DRIVER[0], "-c", MISPLACED])
    assert len(found) == len(RECIPES) + 1, output[-6000:]
    return found


@pytest.fixture(scope="module")
def reports(rehearsed) -> dict[str, dict]:
    return {r["recipe"]: r for r in rehearsed[:len(RECIPES)]}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_gpu_recipe_starts_where_its_plan_says(reports, recipe):
    report = reports[recipe]
    if recipe not in GPU_RECIPES:
        assert report["skipped"].startswith("written for the CPU"), report
        return
    assert "skipped" not in report and report["problems"] == [], report
    trainer, servers = report["records"]["trainer"], report["records"]["servers"]
    assert len({t["address"] for t in trainer} | {s["address"] for s in servers.values()}) == report["nodes"]


def test_the_flagship_shapes_are_kept(reports):
    """GLM-4.5 and DeepSeek-V3 colocated, their engines two nodes wide beside the trainer ranks; Qwen3-235B's
    engine two nodes wide on nodes of its own; Qwen3-30B's two engines on the one trainer node."""
    for name in ("glm45_355b_a32b", "deepseek_v3_671b"):
        servers = reports[name]["records"]["servers"]
        assert sorted(servers) == ["0/0", "0/1", "1/0", "1/1"] and reports[name]["nodes"] == 4
        assert "parallel.world_size=8" in reports[name]["overrides"]
        assert not [o for o in reports[name]["overrides"] if o.startswith(("parallel.pp", "parallel.vpp", "placement"))]
        assert len({s["address"] for s in servers.values()}) == 4
        assert all(s["flags"]["--nnodes"] == "2" and "--enable-memory-saver" in s["flags"] for s in servers.values())
    big = reports["qwen3_235b_a22b"]["records"]
    assert not {t["address"] for t in big["trainer"]} & {s["address"] for s in big["servers"].values()}
    small = reports["qwen3_30b_a3b"]["records"]
    assert len({t["address"] for t in small["trainer"]} | {s["address"] for s in small["servers"].values()}) == 1


def test_engines_on_another_node_than_their_trainer_ranks_are_caught(rehearsed):
    problems = rehearsed[-1]["problems"]
    assert any("engine 0 rank 0 runs on" in p and "the plan puts it on node 0" in p for p in problems), problems
    assert any(p.startswith("CUDA IPC: trainer rank 0") for p in problems), problems
