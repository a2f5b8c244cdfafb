"""The host copies delta syncs keep (``sync.delta``), per node, against the node's memory
(megarl/planner/delta_memory.py): the planner reports a layout whose copies do not fit as a broken limit
naming ``sync.delta``, and the driver refuses it at start (exit 2, one line). Over ``distributed`` and
``tensor`` every engine rank keeps the whole model (the 235B recipe: 8 ranks x 438 GiB on an engine node);
over ``sharded`` only its slices.
"""
import time

import pytest

from megarl.config import ConfigError, load_config
from megarl.planner.delta_memory import DELTA_HOST_SHARE, busiest_node, check_delta_memory
from megarl.planner.layout import broken_limits, plan_layout
from megarl.planner.params import count_params
from megarl.planner.units import GIB

pytestmark = pytest.mark.unit


def test_distributed_delta_keeps_the_whole_model_per_engine_rank_and_a_stage_share_per_sender():
    cfg = load_config(["recipe=qwen3_235b_a22b", "sync.delta=true", "cluster.host_memory_gb=2048"])
    plan = plan_layout(cfg)
    model_bytes = count_params(plan.arch).total * 2  # bf16
    assert plan.sync.delta_host_bytes == model_bytes
    node = busiest_node(plan.arch, cfg)
    ranks_per_node = min(cfg.cluster.gpus_per_node, cfg.rollout.engine_tp)
    assert (node.engine_ranks, node.engine_rank_bytes) == (ranks_per_node, model_bytes)  # an engine node
    assert node.bytes == ranks_per_node * model_bytes > DELTA_HOST_SHARE * 2048 * GIB
    (line,) = [b for b in broken_limits(plan, cfg) if b.startswith("sync.delta")]
    assert f"{ranks_per_node} engine ranks x {model_bytes / GIB:.1f} GiB" in line and "sync.transport=sharded" in line
    with pytest.raises(ConfigError, match=r"^sync.delta: delta syncs keep 3.*GiB of host copies on node"):
        check_delta_memory(cfg, 2048 * GIB)
    senders = load_config(["recipe=qwen3_30b_a3b", "sync.delta=true"])  # colocated: engines and the sender share
    node = busiest_node(plan_layout(senders).arch, senders)
    assert node.trainer_ranks == senders.parallel.pp == 1 and node.trainer_rank_bytes == node.engine_rank_bytes
    assert node.engine_ranks == senders.rollout.num_engines * senders.rollout.engine_tp
    assert not [b for b in broken_limits(plan_layout(senders), senders) if b.startswith("sync.delta")]  # unchecked


def test_sharded_delta_keeps_slices_and_fits_where_distributed_does_not():
    base = ["recipe=qwen3_235b_a22b", "sync.delta=true", "cluster.host_memory_gb=2048", "parallel.pp=1",
            "parallel.world_size=64", "parallel.first_stage_layers=null", "parallel.last_stage_layers=null"]
    sharded = load_config([*base, "sync.transport=sharded"])
    plan = plan_layout(sharded)
    node = busiest_node(plan.arch, sharded)
    assert node.engine_rank_bytes == plan.sync.delta_host_bytes < count_params(plan.arch).total * 2 / 8
    assert node.bytes <= DELTA_HOST_SHARE * 2048 * GIB
    check_delta_memory(sharded, 2048 * GIB)
    assert not [b for b in broken_limits(plan, sharded) if b.startswith("sync.delta")]
    with pytest.raises(ConfigError, match=r"^sync.delta: .* use sync.transport=sharded \(each rank keeps only"):
        check_delta_memory(load_config([*base, "sync.transport=distributed"]), 2048 * GIB)


def test_the_driver_refuses_delta_copies_over_the_nodes_memory(tmp_path, capsys):
    from megarl.train import main

    args = ["recipe=tiny_moe_cpu", "sync.delta=true", f"logging.run_dir={tmp_path / 'run'}",
            f"model.hf_path={tmp_path / 'absent'}", f"warmup.save_hf_path={tmp_path / 'sft'}"]
    check_delta_memory(load_config(args), 24 * GIB)  # the tiny model's copies fit a small machine
    t0 = time.perf_counter()
    assert main([*args, "cluster.host_memory_gb=0.001"]) == 2
    assert time.perf_counter() - t0 < 10
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("megarl: config error: sync.delta: delta syncs keep "), err
    assert "(cluster.host_memory_gb)" in err and not (tmp_path / "run" / "metrics.jsonl").exists()
