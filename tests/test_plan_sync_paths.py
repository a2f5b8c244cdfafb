"""The planner's projection of each weight-sync path (megarl/planner/weight_sync.py) and its output."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megarl.config import load_config
from megarl.planner.layout import plan_layout
from megarl.planner.weight_sync import (
    DELTA_CHANGE_FRACTION,
    H2D_GBPS,
    IPC_COPY_GBPS,
    delta_wire_fraction,
    engine_rank_params,
    trainer_rank_params,
)


@pytest.mark.unit
@pytest.mark.parametrize("changed, expected", [
    (0.0005, 0.0005 * 4 / 2),  # bf16: gaps (steps of ~2000 fit in 16 bits), 4 bytes per change over 2 per element
    (1e-6, 1e-6 * 6 / 2),  # steps of ~10**6: sparse, int32 indices
    (0.1, (1 / 8 + 0.1 * 2) / 2),  # bitmap: one bit per element + the changed values
    (0.99, 1.0),  # whole
])
def test_delta_wire_fraction_is_the_smallest_encoding(changed, expected):
    assert delta_wire_fraction(changed, 2) == pytest.approx(expected)


@pytest.mark.unit
def test_every_path_is_projected_from_its_inputs():
    cfg = load_config(["recipe=qwen3_235b_a22b"])
    plan = plan_layout(cfg)
    sync = plan.sync
    nbytes, gbps = sync.bytes_per_sync, cfg.sync.link_gbps
    assert sync.path == "broadcast" and set(sync.sync_seconds) == {"broadcast", "delta", "colocated_ipc",
                                                                   "sharded_p2p", "delta_sharded"}
    wire = DELTA_CHANGE_FRACTION * 4 / 2
    rank_bytes = engine_rank_params(plan.arch, cfg.rollout.engine_tp) * 2
    by_hand = {"broadcast": nbytes * 8 / (gbps * 1e9),
               "delta": nbytes * wire * 8 / (gbps * 1e9) + nbytes / cfg.parallel.pp * 8 / (H2D_GBPS * 1e9),
               # every engine GPU's trainer rank receives the model (the stage senders' broadcast), then each
               # engine rank copies its share from its own GPU
               "colocated_ipc": nbytes * 8 / (gbps * 1e9) + nbytes / cfg.rollout.engine_tp * 8 / (IPC_COPY_GBPS * 1e9),
               "sharded_p2p": rank_bytes * 8 / (gbps * 1e9),
               "delta_sharded": rank_bytes * wire * 8 / (gbps * 1e9)
               + trainer_rank_params(plan.arch, cfg.parallel) * 2 * 8 / (H2D_GBPS * 1e9)}
    assert sync.sync_seconds == pytest.approx(by_hand)
    assert sync.paths["sharded_p2p"].built and sync.paths["delta"].bytes == int(nbytes * wire)
    assert sync.paths["delta_sharded"].bytes == int(rank_bytes * cfg.rollout.engine_tp * wire)
    one_stage = ["recipe=qwen3_235b_a22b", "sync.transport=sharded", "parallel.pp=1"]
    assert plan_layout(load_config(one_stage)).sync.path == "sharded_p2p"
    both = plan_layout(load_config([*one_stage, "sync.delta=true"])).sync
    assert both.path == "delta_sharded" and both.delta_host_bytes == rank_bytes
    assert plan_layout(load_config(["recipe=qwen3_235b_a22b", "sync.delta=true"])).sync.path == "delta"
    assert plan_layout(load_config(["recipe=glm45_355b_a32b"])).sync.path == "colocated_ipc"


@pytest.mark.unit
def test_trainer_rank_params_split_the_model_over_the_layout():
    from megarl.planner.params import count_params, layer_params

    arch = plan_layout(load_config(["recipe=qwen3_235b_a22b"])).arch
    total = count_params(arch).total
    assert trainer_rank_params(arch, SimpleNamespace(tp=1, pp=1, ep=1, etp=None)) == total  # one rank holds it all
    assert trainer_rank_params(arch, SimpleNamespace(tp=1, pp=2, ep=1, etp=None)) == round(total / 2)
    routed = count_params(arch).routed_experts  # an MoE's bulk: over ep * etp, the rest over tp
    assert trainer_rank_params(arch, SimpleNamespace(tp=2, pp=1, ep=4, etp=1)) == round(
        (total - routed) / 2 + routed / 4 + sum(layer_params(arch, i).replicated for i in range(arch.num_layers)) / 2
        + arch.hidden_size / 2)


@pytest.mark.processes
def test_plan_json_has_each_paths_seconds(tmp_path):
    out = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "megarl.plan", "recipe=qwen3_235b_a22b", "sync.delta=true", "--json",
                    str(out)], check=True, capture_output=True)
    sync = json.loads(out.read_text())["sync"]
    assert sync["path"] == "delta" and sync["sync_seconds"]["delta"] < sync["sync_seconds"]["broadcast"]
    assert sync["delta_host_bytes"] == sync["bytes_per_sync"]
