"""The placement rehearsal's rules without its cluster (megarl/rehearsal/): the scaling rule keeps each GPU
recipe's shape on at most 4 nodes of 2 GPUs, the checks pass a placement that matches the plan and name
each way one can go wrong (engine on another node, on another GPU than the trainer rank it shares, a server
missing or cut off from its node 0, NCCL settings that differ, a relative path), and ``megarl.plan
--rehearse`` reports what they found. The rehearsal itself runs in tests/test_rehearsal.py."""
from __future__ import annotations

import copy

import pytest

from megarl.config import load_config
from megarl.config.topology import RunTopology
from megarl.engines.server import nodes_of
from megarl.planner.placement import place
from megarl.rehearsal.checks import Records, check_all
from megarl.rehearsal.scale import MAX_NODES, NODE_GPUS, not_rehearsable, scale

pytestmark = pytest.mark.unit

GPU_RECIPES = ["glm45_355b_a32b", "deepseek_v3_671b", "qwen3_235b_a22b", "qwen3_30b_a3b", "qwen3_30b_a3b_lora"]


def scaled(name: str):
    return load_config([f"recipe={name}", *scale(load_config([f"recipe={name}"])).overrides])


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_the_scaled_recipe_keeps_its_shape_on_a_few_nodes(name):
    big, small = load_config([f"recipe={name}"]), scaled(name)
    assert not_rehearsable(big) is None
    assert small.cluster.gpus_per_node == NODE_GPUS and small.topology.nodes <= MAX_NODES
    for key in ("placement", "parallel.pp", "parallel.vpp", "sync.transport", "rollout.engine_dp_attention",
                "lora.enabled"):
        head, _, tail = key.partition(".")
        assert (getattr(getattr(big, head), tail) if tail else getattr(big, head)) == \
            (getattr(getattr(small, head), tail) if tail else getattr(small, head)), key
    wide = lambda cfg: nodes_of(cfg.rollout.engine_tp, cfg.cluster.gpus_per_node) > 1  # noqa: E731
    assert wide(big) == wide(small)  # an engine wider than a node stays wider than one
    shares = lambda cfg: cfg.rollout.engine_tp / cfg.cluster.gpus_per_node  # noqa: E731
    assert (shares(big) < 1) == (shares(small) < 1)
    if big.placement == "colocated":  # engines cover the same share of the trainer's devices
        cover = lambda cfg: cfg.rollout.num_engines * cfg.rollout.engine_tp / cfg.parallel.world_size  # noqa: E731
        assert cover(small) == cover(big)


def test_the_flagships_keep_two_engines_two_nodes_wide():
    for name in ("glm45_355b_a32b", "deepseek_v3_671b"):
        cfg = scaled(name)
        assert (cfg.parallel.world_size, cfg.rollout.num_engines, cfg.rollout.engine_tp) == (8, 2, 4)
    assert scaled("qwen3_235b_a22b").parallel.cp == 2


def test_cpu_recipes_are_not_rehearsed():
    assert not_rehearsable(load_config(["recipe=tiny_moe_cpu"])).startswith("written for the CPU")


def glm_records():
    """The GLM recipe scaled (8 trainer ranks on 4 nodes of 2 GPUs, 2 engines of 4 ranks over 2 nodes each)
    and records of a placement that matches its plan."""
    cfg = scaled("glm45_355b_a32b")
    nccl = {"NCCL_CUMEM_ENABLE": "0"}
    trainer = [{"rank": i, "address": f"10.0.0.{i // 2}", "gpus": [str(i % 2)], "cuda_visible_devices": str(i % 2),
                "nccl": dict(nccl)} for i in range(8)]
    servers = {}
    for e in range(2):
        for k in range(2):
            flags = {"--tp-size": "4", "--nnodes": "2", "--node-rank": str(k), "--base-gpu-id": "0",
                     "--model-path": "/models/glm", "--dist-init-addr": f"10.0.0.{2 * e}:2000"}
            servers[(e, k)] = {"address": f"10.0.0.{2 * e + k}", "cuda_visible_devices": "0,1", "flags": flags,
                               "nccl": dict(nccl), "output": f"/runs/engine-{e}.log", "reached": k == 1}
    return cfg, Records(trainer, servers)


def problems_of(cfg, records):
    return check_all(cfg, "/runs/checkpoints", place(RunTopology.from_config(cfg)), records)


def test_a_placement_as_planned_passes():
    cfg, records = glm_records()
    assert problems_of(cfg, records) == []


def test_an_engine_on_another_node_is_caught():
    cfg, records = glm_records()
    records.servers[(1, 0)]["address"] = "10.0.0.0"  # engine 1's node 0 beside trainer ranks 0-1, not 4-5
    problems = problems_of(cfg, records)
    assert "engine 1 rank 0 runs on 10.0.0.0, but the plan puts it on node 2 (10.0.0.2)" in problems
    assert "engine 1 rank 1 and engine 0 rank 1 both use GPU 1 of 10.0.0.0" in problems
    assert any(p.startswith("CUDA IPC: trainer rank 4 (GPU ['0'] of 10.0.0.2) feeds engine 1 rank 0") for p in problems)


def test_an_engine_rank_on_another_gpu_than_its_trainer_rank_is_caught():
    cfg, records = glm_records()
    records.servers[(0, 1)]["cuda_visible_devices"] = "1,0"
    problems = problems_of(cfg, records)
    assert ("engine 0 rank 2 uses GPU 1 of 10.0.0.1, but shares trainer rank 2's device, GPU ['0'] of 10.0.0.1"
            in problems)
    records.servers[(0, 1)]["flags"]["--base-gpu-id"] = "1"
    assert any("--base-gpu-id 1 + 1 is past its CUDA_VISIBLE_DEVICES='1,0'" in p for p in problems_of(cfg, records))


def test_missing_servers_cut_off_nodes_nccl_and_relative_paths_are_caught():
    cfg, records = glm_records()
    broken = copy.deepcopy(records)
    del broken.servers[(1, 1)]
    broken.servers[(0, 1)]["reached"] = False
    broken.servers[(1, 0)]["nccl"] = {}
    broken.servers[(0, 0)]["flags"]["--model-path"] = "models/glm"
    problems = problems_of(cfg, broken)
    assert "engine 1 node 1: no server started" in problems
    assert "engine 0 node 1 did not reach node 0 at --dist-init-addr 10.0.0.0:2000" in problems
    assert any(p.startswith("NCCL environment of engine 1 node 0 {} differs from trainer rank 0's") for p in problems)
    assert "engine 0 node 0 --model-path is not an absolute path: 'models/glm'" in problems
    records.trainer[3]["gpus"] = ["0"]
    assert any("trainer ranks 2 and 3 share GPU 0 of 10.0.0.1" in p for p in problems_of(cfg, records))


def test_plan_rehearse_reports_the_problems_and_exits_2(monkeypatch, capsys):
    import megarl.rehearsal.cluster as cluster
    from megarl.plan import main

    seen = []

    def rehearse(recipes, overrides):
        seen.append((list(recipes), list(overrides)))
        return [{"recipe": recipes[0], "nodes": 1, "overrides": ["parallel.world_size=2"], "problems": ["engine x"]}]

    monkeypatch.setattr(cluster, "rehearse", rehearse)
    assert main(["recipe=qwen3_30b_a3b", "rollout.top_k=50", "--rehearse"]) == 2
    out, err = capsys.readouterr()
    assert seen == [(["qwen3_30b_a3b"], ["rollout.top_k=50"])]
    assert "placement rehearsal on 1 fake nodes, scaled by parallel.world_size=2: 1 problems" in out
    assert err.strip().splitlines()[-1] == "plan: rehearsal: engine x"

    def unavailable(recipes, overrides):
        raise cluster.RehearsalUnavailable("the placement rehearsal brings up fake nodes: they need root")

    monkeypatch.setattr(cluster, "rehearse", unavailable)
    assert main(["recipe=qwen3_30b_a3b", "--rehearse"]) == 1
    assert capsys.readouterr().err.strip().endswith("they need root")
    assert main(["recipe=qwen3_30b_a3b"]) == 0  # without the flag, no rehearsal


def test_the_stand_in_server_reads_the_engines_flags():
    from megarl.rehearsal import stand_in_server

    assert stand_in_server.flags_of(["--host", "h", "--enable-memory-saver", "--tp-size", "4"]) == {
        "--host": "h", "--enable-memory-saver": "", "--tp-size": "4"}
