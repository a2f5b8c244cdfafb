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


def _encoded_fraction(every: int, numel: int = 2**22) -> tuple[float, float]:
    """(changed fraction, wire bytes over whole bytes) of a bf16 tensor whose every ``every``-th element
    changed (``every`` < 0: all but every ``-every``-th), encoded by the delta sync's own encoder."""
    import torch

    from megarl.wire.weight_delta import changed_mask, choose, encode, largest_gap

    old = torch.zeros(numel, dtype=torch.bfloat16)
    new = old.clone()
    if every > 0:
        new[::every] = 1.0
    else:
        new[:] = 1.0
        new[::-every] = 0.0
    mask = changed_mask(new, old)
    changed = int(mask.sum())
    pieces = encode("w", new, mask, choose(numel, changed, 2, largest_gap(mask)))
    return changed / numel, sum(t.numel() * t.element_size() for _, t in pieces) / (numel * 2)


@pytest.mark.unit
@pytest.mark.parametrize("every", [2000, 10**6, 10, -100], ids=["gaps", "sparse", "bitmap", "whole"])
def test_delta_wire_fraction_is_what_the_encoder_sends(every):
    """The planner's wire fraction for evenly spread changes against the bytes the delta sync's encoder
    (megarl/wire/weight_delta.py) makes of such a tensor."""
    changed, sent = _encoded_fraction(every)
    assert delta_wire_fraction(changed, 2) == pytest.approx(sent, rel=1e-3)


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
