"""The placement report of ``python -m megarl.plan``: which node and device holds each trainer and
engine rank, the weight-sync groups, and the layouts that cannot be placed (exit 2, one line
naming the key, refused as well by the driver before anything starts)."""
from __future__ import annotations

import json
import re

import pytest

from megarl.config import load_config
from megarl.config.errors import PlacementError
from megarl.config.topology import RunTopology, engine_devices_start, pool_engine_settings
from megarl.engines.server import EngineSettings
from megarl.plan import EXIT_DOES_NOT_FIT, main
from megarl.planner.placement import Device
from megarl.planner.placement import place as place_topology


def place(cfg):
    return place_topology(RunTopology.from_config(cfg))


pytestmark = pytest.mark.unit

# Qwen3-30B-A3B's numbers on two nodes of 4 devices: 4 trainer ranks (TP2 x PP2), 2 engines x TP2.
TWO_NODES = ["recipe=qwen3_30b_a3b", "cluster.gpus_per_node=4", "parallel.world_size=4", "parallel.tp=2",
             "parallel.pp=2", "parallel.ep=2", "rollout.num_engines=2", "rollout.engine_tp=2"]
DISAGGREGATED = ["placement=disaggregated", "sync.transport=distributed"]


def test_disaggregated_two_nodes_trainer_then_engines():
    plan = place(load_config(TWO_NODES + DISAGGREGATED))
    assert plan.nodes == 2
    assert plan.trainer == [Device(0, 0), Device(0, 1), Device(0, 2), Device(0, 3)]
    assert plan.engines == [[Device(1, 0), Device(1, 1)], [Device(1, 2), Device(1, 3)]]
    # one group per pipeline stage: the stage's TP/DP rank 0 and the four engine ranks
    assert [(g.stage, g.sender, g.size) for g in plan.sync_groups] == [(0, 0, 5), (1, 2, 5)]
    assert plan.sync_groups[0].engine_ranks == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_colocated_two_nodes_engines_on_the_trainer_devices():
    plan = place(load_config(TWO_NODES + ["parallel.world_size=8", "rollout.engine_tp=4"]))
    assert plan.nodes == 2 and plan.placement == "colocated"
    assert plan.trainer == [Device(i // 4, i % 4) for i in range(8)]
    assert plan.engines == [[Device(0, i) for i in range(4)], [Device(1, i) for i in range(4)]]
    assert [(g.stage, g.sender) for g in plan.sync_groups] == [(0, 0), (1, 4)]


def test_report_lists_node_and_device_of_every_rank(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(TWO_NODES + DISAGGREGATED + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "placement (disaggregated): 2 nodes x 4 GPUs" in text
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    # node, devices, trainer ranks, stage, engine, engine ranks
    assert ["0", "0-1", "0-1", "0", "-", "-"] in rows and ["0", "2-3", "2-3", "1", "-", "-"] in rows
    assert ["1", "0-1", "-", "-", "0", "0-1"] in rows and ["1", "2-3", "-", "-", "1", "0-1"] in rows
    assert ["0", "rank 0 (0:0)", "2 engines x 2", "5", "0-1"] in rows
    assert ["1", "rank 2 (0:2)", "2 engines x 2", "5", "0-1"] in rows
    placement = json.loads(out.read_text())["placement"]
    assert placement["nodes"] == 2
    assert placement["engines"][1] == [{"node": 1, "device": 2}, {"node": 1, "device": 3}]
    assert [g["sender"] for g in placement["sync_groups"]] == [0, 2]


def test_engines_do_not_straddle_a_node_they_fit_in():
    assert engine_devices_start(6, engine_tp=2, gpus_per_node=4) == 6
    assert engine_devices_start(6, engine_tp=4, gpus_per_node=4) == 8
    assert engine_devices_start(6, engine_tp=8, gpus_per_node=4) == 8  # two whole nodes
    plan = place(load_config(TWO_NODES + DISAGGREGATED + ["parallel.world_size=6", "parallel.pp=1",
                                                          "parallel.ep=2", "rollout.engine_tp=4"]))
    assert plan.nodes == 4 and plan.engines[0][0] == Device(2, 0) and plan.engines[1][3] == Device(3, 3)


AUXILIARY = ["teacher.hf_path=/ckpt/teacher", "algorithm.opd_coef=1.0", "reward.judge.hf_path=/ckpt/judge",
             "reward.judge.engine_tp=1", "task.agent=agent_examples:solver_and_frozen_verifier",
             "task.roles=[solver,verifier]", "task.role_engines=[{role:verifier,hf_path:/ckpt/verifier}]",
             "task.chat_template=false"]  # the gateway renders the chat


def test_the_teacher_judge_and_frozen_roles_get_devices_of_their_own(capsys):
    """Auxiliary engines follow the policy's engines (disaggregated) or the trainer (colocated), each on
    devices of its own, none straddling a node it fits in; the report and the node count include them."""
    plan = place(load_config(TWO_NODES + DISAGGREGATED + AUXILIARY))
    # trainer 0-3 (node 0), engines 4-7 (node 1), teacher 8-9, judge 10, the verifier from 12 (not 11-12)
    assert plan.auxiliary == {"teacher": [Device(2, 0), Device(2, 1)], "judge": [Device(2, 2)],
                              "role-verifier": [Device(3, 0), Device(3, 1)]}
    assert plan.nodes == 4
    colocated = place(load_config(TWO_NODES + AUXILIARY))
    assert colocated.engines == [[Device(0, 0), Device(0, 1)], [Device(0, 2), Device(0, 3)]]
    assert colocated.auxiliary == {"teacher": [Device(1, 0), Device(1, 1)], "judge": [Device(1, 2)],
                                   "role-verifier": [Device(2, 0), Device(2, 1)]}
    assert colocated.nodes == 3
    assert main(TWO_NODES + DISAGGREGATED + AUXILIARY) == 0
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("│")]
    assert ["2", "0-1", "-", "-", "teacher", "0-1"] in rows and ["2", "2", "-", "-", "judge", "0"] in rows
    assert ["3", "0-1", "-", "-", "role-verifier", "0-1"] in rows
    with pytest.raises(PlacementError, match=r"^cluster.num_nodes: 4 trainer ranks and 2 engines x 2 ranks and the "
                                             r"teacher engine's 2, judge engine's 1, role-verifier engine's 2 need "
                                             r"14 devices \(4 nodes of 4\), more than 3 nodes"):
        load_config(TWO_NODES + DISAGGREGATED + AUXILIARY + ["cluster.num_nodes=3"])


def test_stage_senders_are_megatron_tp_dp_cp_rank_zero():
    """The sender of each stage is rank ``stage * world / pp``: the TP-, CP- and DP-rank-0 rank of
    that stage in megatron-core's own rank order."""
    from megatron.core.parallel_state import RankGenerator

    for tp, cp, dp, pp in [(2, 1, 2, 2), (2, 2, 1, 4), (4, 1, 2, 2), (1, 1, 1, 3)]:
        world = tp * cp * dp * pp
        pipeline_of_rank_0 = next(g for g in RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp,
                                                           order="tp-cp-ep-dp-pp").get_ranks("pp") if 0 in g)
        cfg = load_config(["recipe=qwen3_30b_a3b", f"parallel.world_size={world}", f"parallel.tp={tp}",
                           f"parallel.cp={cp}", f"parallel.pp={pp}", "parallel.ep=1", "rollout.num_engines=1",
                           "rollout.engine_tp=1"])
        assert [g.sender for g in place(cfg).sync_groups] == list(pipeline_of_rank_0), (tp, cp, dp, pp)


BAD_LAYOUTS = {
    "more ranks than devices (disaggregated)": (
        TWO_NODES + DISAGGREGATED + ["cluster.num_nodes=1"], "cluster.num_nodes",
        "4 trainer ranks and 2 engines x 2 ranks need 8 devices (2 nodes of 4), more than 1 nodes x 4 = 4"),
    "more engine ranks than trainer devices (colocated)": (
        TWO_NODES + ["rollout.num_engines=3"], "rollout.num_engines",
        "colocated engines need 6 devices (num_engines x engine_tp = 3 x 2), more than the trainer's 4"),
    "engine_tp does not divide the attention heads": (
        ["recipe=glm45_355b_a32b", "rollout.num_engines=4", "rollout.engine_tp=64"], "rollout.engine_tp",
        "96 attention heads are not divisible by engine_tp=64"),
    "engine_ep does not divide the experts": (
        TWO_NODES + DISAGGREGATED + ["model.arch.num_experts=136", "cluster.gpus_per_node=16",
                                     "rollout.engine_tp=16", "rollout.engine_ep=16"], "rollout.engine_ep",
        "16 must divide engine_tp=16 and the 136 experts"),
    "engine_ep does not divide engine_tp": (
        ["recipe=qwen3_235b_a22b", "rollout.engine_ep=3"], "rollout.engine_ep", "3 must divide engine_tp=16"),
    "a teacher's engine straddles nodes": (
        TWO_NODES + AUXILIARY + ["teacher.engine_tp=3"], "teacher.engine_tp",
        "an engine of 3 ranks on nodes of cluster.gpus_per_node=4 would straddle nodes"),
    "a frozen role's engine_ep does not divide its engine_tp": (
        TWO_NODES + AUXILIARY + ["task.role_engines=[{role:verifier,hf_path:/ckpt/verifier,engine_tp:2,engine_ep:4}]"],
        "task.role_engines[0].engine_ep", "4 must divide engine_tp=2"),
    "DP attention on a one-rank teacher": (
        TWO_NODES + AUXILIARY + ["rollout.engine_dp_attention=true", "teacher.engine_tp=1"], "teacher.engine_tp",
        "DP attention (rollout.engine_dp_attention) runs one attention replica per rank and needs engine_tp > 1"),
    "an engine straddles nodes": (
        TWO_NODES + ["rollout.engine_tp=4", "cluster.gpus_per_node=6", "parallel.world_size=8"],
        "rollout.engine_tp", "an engine of 4 ranks on nodes of cluster.gpus_per_node=6 would straddle nodes"),
}


@pytest.mark.parametrize("case", list(BAD_LAYOUTS))
def test_layout_that_cannot_be_placed_exits_2_naming_the_key(case, capsys):
    overrides, key, why = BAD_LAYOUTS[case]
    assert main(overrides) == EXIT_DOES_NOT_FIT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"plan: cannot be placed: {key}: "), err
    assert why in err, err
    with pytest.raises(PlacementError, match=re.escape(key)):
        load_config(overrides)


def test_the_driver_refuses_it_before_starting_anything(tmp_path, capsys):
    from megarl.train import main as train

    assert train(["recipe=tiny_moe_cpu", "placement=colocated", "sync.transport=tensor", "rollout.num_engines=2",
                  f"logging.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megarl: config error: rollout.num_engines: colocated engines need 2 devices"), err
    assert not (tmp_path / "run").exists()


def test_colocated_needs_the_tensor_transport(capsys):
    from megarl.train import main as train

    assert train(["recipe=tiny_moe_cpu", "placement=colocated", "sync.transport=disk"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("megarl: config error: sync.transport: colocated placement needs sync.transport=tensor (the "
                   "engines load the buckets from the trainer's memory on the same devices), got 'disk'")


def test_auxiliary_engines_are_served_on_ranks_of_their_own(tmp_path):
    """``teacher.engine_tp`` / ``engine_ep`` place the teacher on that many devices and the driver serves it
    on them (a frozen role likewise); unset they are the policy's; the judge's are its own. Each takes
    ``rollout.mem_fraction_static``."""
    from megarl.models.tiny_moe import make_tiny_moe
    from megarl.platform.description import Platform

    def served(cfg, name: str) -> EngineSettings:
        topology = RunTopology.from_config(cfg)
        [settings] = pool_engine_settings(cfg, topology, topology.pool(name), Platform.cpu(), "k")
        return settings

    tiny = str(make_tiny_moe(tmp_path / "tiny"))  # 4 heads, 2 KV heads, 8 experts: TP2 x EP2 fits
    own = TWO_NODES + DISAGGREGATED + AUXILIARY + [
        f"teacher.hf_path={tiny}", "teacher.engine_tp=4", "teacher.engine_ep=2", "reward.judge.engine_tp=2",
        f"reward.judge.hf_path={tiny}", "reward.judge.engine_ep=2", "rollout.mem_fraction_static=0.7",
        f"task.role_engines=[{{role:verifier,hf_path:{tiny},engine_tp:2,engine_ep:2}}]",
        f"logging.run_dir={tmp_path / 'run'}"]
    with pytest.raises(PlacementError, match=r"^teacher.engine_tp: 4 attention heads are not divisible by engine_tp=8"):
        load_config(own + ["teacher.engine_tp=8", "cluster.gpus_per_node=8"])
    cfg = load_config(own)
    plan = place(cfg)
    # trainer 0-3, engines 4-7, the teacher a node of its own (8-11), the judge 12-13, the verifier 14-15
    assert plan.auxiliary == {"teacher": [Device(2, k) for k in range(4)], "judge": [Device(3, 0), Device(3, 1)],
                              "role-verifier": [Device(3, 2), Device(3, 3)]}
    for name, tp, ep in (("teacher", 4, 2), ("role-verifier", 2, 2)):
        settings = served(cfg, name)
        assert (settings.model_path, settings.tp, settings.ep, settings.mem_fraction_static) == (tiny, tp, ep, 0.7)
        assert settings.log_path == str(tmp_path / "run" / f"{name}.log") and settings.lora_max_rank == 0
    settings = served(cfg, "judge")
    assert (settings.tp, settings.ep, settings.mem_fraction_static) == (2, 2, 0.7)
    # the policy's engines over two nodes of 4 (TP8, which the tiny teacher's 4 heads could not take): the
    # teacher is served on its own TP4 x EP2, one node
    wide = load_config(own + ["rollout.engine_tp=8", "rollout.num_engines=1"])
    settings = served(wide, "teacher")
    assert (settings.tp, settings.ep, settings.nnodes) == (4, 2, 1)
    default = RunTopology.from_config(load_config(TWO_NODES + DISAGGREGATED + AUXILIARY)).auxiliary
    assert [(a.name, a.devices, a.ep) for a in default] == [("teacher", 2, 1), ("judge", 1, 1),
                                                             ("role-verifier", 2, 1)]


# --- colocated engines pinned beside their trainer ranks, trainer ranks filling whole nodes -----------

def _places(nodes: list[str], gpus: list[str]):
    from megarl.parallel.places import Place

    return [Place(f"id-{node}", node, (gpu,)) for node, gpu in zip(nodes, gpus)]


def test_each_engine_node_is_seated_beside_its_trainer_ranks():
    """An engine of 4 ranks over 2 nodes of 2 GPUs: node k's server on the node of trainer ranks 4e + 2k..,
    with their GPUs in rank order; an engine of 2 ranks on one node likewise."""
    from megarl.engines.pinning import colocated_seats

    places = _places(["a", "a", "b", "b", "c", "c", "d", "d"], ["1", "0", "0", "1", "1", "0", "0", "1"])
    seats = [colocated_seats(places, e, 4, 2) for e in range(2)]
    assert [[(s.address, s.gpus) for s in engine] for engine in seats] == [
        [("a", ("1", "0")), ("b", ("0", "1"))], [("c", ("1", "0")), ("d", ("0", "1"))]]
    assert [s.node_id for s in seats[1]] == ["id-c", "id-d"]
    assert [(s.address, s.gpus) for s in colocated_seats(places, 3, 2, 1)] == [("d", ("0", "1"))]
    cpu = [p.__class__(p.node_id, p.address) for p in places]  # CPU ranks: the node alone
    assert [(s.address, s.gpus) for s in colocated_seats(cpu, 1, 2, 1)] == [("b", ())]


def test_an_engine_whose_trainer_ranks_are_split_or_crowded_is_refused():
    from megarl.engines.pinning import colocated_seats

    split = _places(["a", "b", "b", "b"], ["0", "0", "1", "2"])
    with pytest.raises(ValueError, match=r"engine 0's node 0 shares the devices of trainer ranks 0-1, which Ray "
                                         r"placed on several nodes \(rank 0 on a, rank 1 on b\)"):
        colocated_seats(split, 0, 2, 1)
    one_node = _places(["a"] * 4, ["0", "1", "2", "3"])
    with pytest.raises(ValueError, match=r"engine 0 spans 2 nodes, but the trainer ranks it shares sit on \['a'\]"):
        colocated_seats(one_node, 0, 4, 2)
    shared = _places(["a", "a"], ["0", "0"])
    with pytest.raises(ValueError, match=r"hold GPUs \['0', '0'\] on a, not one each"):
        colocated_seats(shared, 0, 2, 1)
    with pytest.raises(ValueError, match="the trainer has 4"):
        colocated_seats(one_node, 1, 4, 1)


def test_trainer_ranks_fill_whole_gpu_nodes_in_rank_order():
    """On GPUs one bundle a node (the last one smaller), on distinct nodes, rank r in bundle r // gpus_per_node;
    on CPUs a bundle a rank, packed."""
    from megarl.trainer.actor import RankDevices

    bundles, strategy, bundle_of = RankDevices(True, 4).bundles(10, {"megarl_trainer": 1.0})
    assert bundles == [{"GPU": 4, "CPU": 4, "megarl_trainer": 4.0}] * 2 + [{"GPU": 2, "CPU": 2, "megarl_trainer": 2.0}]
    assert strategy == "STRICT_SPREAD" and bundle_of == [0] * 4 + [1] * 4 + [2] * 2
    assert RankDevices(True, 8).bundles(2, {}) == ([{"GPU": 2, "CPU": 2}], "PACK", [0, 0])
    assert RankDevices(False, 8).bundles(3, {}) == ([{"CPU": 1}] * 3, "PACK", [0, 1, 2])


def test_gpu_nodes_of_another_size_than_the_config_are_refused(monkeypatch):
    import ray

    from megarl.trainer.actor import check_gpu_nodes

    nodes = [{"Alive": True, "NodeManagerAddress": "head", "Resources": {"CPU": 8.0}},
             {"Alive": True, "NodeManagerAddress": "n1", "Resources": {"GPU": 4.0}},
             {"Alive": True, "NodeManagerAddress": "n2", "Resources": {"GPU": 4.0}},
             {"Alive": False, "NodeManagerAddress": "gone", "Resources": {"GPU": 2.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    check_gpu_nodes(4, 8)  # the CPU head and a dead node do not count
    with pytest.raises(RuntimeError, match=r"cluster.gpus_per_node=8, but Ray's nodes offer \{'n1': 4, 'n2': 4\} GPUs"):
        check_gpu_nodes(8, 4)  # several nodes: every placement counts by it
    del nodes[2]
    check_gpu_nodes(8, 2)  # one node (a workstation) with room for the ranks: the default 8 does not matter
    with pytest.raises(RuntimeError, match="cluster.gpus_per_node=8"):
        check_gpu_nodes(8, 6)


def test_pinned_followers_run_on_their_seats_node_with_its_gpus():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from megarl.engines.actor import follower_options
    from megarl.parallel.places import Place

    n0, n1 = "ab" * 28, "cd" * 28  # Ray's node ids: 28 bytes in hex
    options, gpus = follower_options([Place(n0, "a", ("0", "1")), Place(n1, "b", ("1", "0"))], 1)
    strategy = options["scheduling_strategy"]
    assert isinstance(strategy, NodeAffinitySchedulingStrategy) and (strategy.node_id, strategy.soft) == (n1, False)
    assert gpus == ("1", "0") and "num_gpus" not in options  # the trainer ranks beside it hold the GPUs


# --- the job's allocation and the run's paths ---------------------------------------------------------

def test_a_job_of_other_nodes_than_the_config_is_refused():
    from megarl.config import ConfigError
    from megarl.config.platform_rules import refuse_beyond_allocation
    from megarl.platform.description import Platform

    cfg = load_config(TWO_NODES + DISAGGREGATED)  # 2 nodes of 4 GPUs
    hopper = Platform.cuda()
    refuse_beyond_allocation(cfg, hopper, {"MEGARL_GPUS_PER_NODE": "4", "MEGARL_NUM_NODES": "2"})
    refuse_beyond_allocation(cfg, hopper, {})  # outside SLURM: nothing to compare with
    refuse_beyond_allocation(cfg, Platform.cpu(), {"MEGARL_GPUS_PER_NODE": "8"})  # a CPU run places no GPU
    with pytest.raises(ConfigError, match=r"^cluster.gpus_per_node: is 4, but this job's nodes have 8 GPUs each "
                                          r"\(MEGARL_GPUS_PER_NODE\): set cluster.gpus_per_node=8$"):
        refuse_beyond_allocation(cfg, hopper, {"MEGARL_GPUS_PER_NODE": "8"})
    with pytest.raises(ConfigError, match=r"^cluster.num_nodes: the layout needs 2 nodes of 4 GPUs, this job has 1"):
        refuse_beyond_allocation(cfg, hopper, {"MEGARL_NUM_NODES": "1"})
    refuse_beyond_allocation(cfg, hopper, {"MEGARL_GPUS_PER_NODE": "h100:4"})  # SLURM's --gpus-per-node=type:N
    with pytest.raises(ConfigError, match=r"^MEGARL_GPUS_PER_NODE: '4\(x2\)' is not a count \(N, or SLURM's type:N\)"):
        refuse_beyond_allocation(cfg, hopper, {"MEGARL_GPUS_PER_NODE": "4(x2)"})


def test_the_driver_refuses_a_layout_beyond_the_job_before_starting_anything(tmp_path, capsys, monkeypatch):
    import time

    from megarl.train import main as train

    monkeypatch.setenv("MEGARL_NUM_NODES", "1")
    t0 = time.monotonic()
    assert train(["recipe=tiny_moe_cpu", "parallel.world_size=16", f"logging.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert time.monotonic() - t0 < 10 and not (tmp_path / "run").exists()
    assert err.startswith("megarl: config error: cluster.num_nodes: the layout needs 3 nodes of 8 GPUs"), err


def test_every_run_path_is_absolute_once_loaded(tmp_path, monkeypatch):
    """Trainer ranks and engines start in their Ray node's working directory: a relative path is made absolute
    where the config is loaded."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["recipe=tiny_moe_cpu", "logging.run_dir=runs/x", "model.hf_path=ckpt",
                       "task.path=data.jsonl", "critic.hf_path=/abs/critic"])
    assert cfg.logging.run_dir == str(tmp_path / "runs/x") and cfg.sync.work_dir == str(tmp_path / "runs/x/weight_sync")
    assert cfg.model.hf_path == str(tmp_path / "ckpt") and cfg.task.path == str(tmp_path / "data.jsonl")
    assert cfg.warmup.save_hf_path == str(tmp_path / "checkpoints/tiny_moe_sft")
    assert cfg.critic.hf_path == "/abs/critic" and cfg.reward.judge.hf_path is None
