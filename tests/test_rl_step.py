"""The RL step on Megatron against HF transformers as the oracle.

With Keep Routing and Keep Sampling Mask the trainer reproduces the engine-side log-probs (here:
HF's, renormalised over each position's top-k set, under the routing HF used) at the first step;
turning either off makes the mismatch measurably larger; the replayed routing is really used (a
forced, different routing is reproduced too); and every layout computes the same gradient.
"""
import pytest

from megarl.config.schema import AlgorithmConfig
from megarl.trainer.distributed import Layout
from megarl.trainer.launch import run_ranks

LAYOUTS = {
    "single": Layout(),
    "tp2_sp": Layout(world_size=2, tp=2, sequence_parallel=True),
    "pp2": Layout(world_size=2, pp=2),
    "ep2": Layout(world_size=2, ep=2),
}


def measure(rank, layout, hf_path):
    """Metrics of rl_step for several settings on the same (frozen: lr=0) model."""
    from hf_oracle import load_hf, make_samples

    from megarl.trainer.model_setup import build_trainable
    from megarl.trainer.optimizer import OptimizerSettings
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import rl_step

    hf = load_hf(hf_path)
    natural = make_samples(hf, 8, top_k=5, seed=1)
    forced = make_samples(hf, 8, top_k=5, seed=1, rotate_experts=3)
    trainable = build_trainable(hf_path, layout, OptimizerSettings(lr=0.0), transformer_impl="local", routing_replay=True)
    multiple = layout.tp if layout.sequence_parallel else 1

    def step(samples, keep_routing=True, keep_mask=True):
        batch = build_rl_batch(samples, pad_id=0, length_multiple=multiple, with_sampling_mask=keep_mask)
        result = rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, AlgorithmConfig(),
                         vocab_size=hf.config.vocab_size, max_tokens_per_microbatch=24, keep_routing=keep_routing,
                         sequence_parallel=layout.sequence_parallel)
        return result.grad_norm, result.metrics

    return {
        "kept": step(natural), "forced_kept": step(forced), "forced_free": step(forced, keep_routing=False),
        "no_mask": step(natural, keep_mask=False),
    }


@pytest.fixture(scope="module")
def single(tiny_checkpoint):
    return run_ranks(measure, LAYOUTS["single"], tiny_checkpoint)[0]


def test_keep_routing_and_mask_reproduce_rollout_logprobs(single):
    grad_norm, kept = single["kept"]
    assert kept["mismatch/logprob_abs_diff"] < 1e-5
    assert abs(kept["mismatch/kl"]) < 1e-5
    assert kept["clip_fraction"] == 0.0
    assert grad_norm > 0


def test_replayed_routing_is_the_one_used(single):
    assert single["forced_kept"][1]["mismatch/logprob_abs_diff"] < 1e-5
    free = single["forced_free"][1]
    assert free["mismatch/logprob_abs_diff"] > 1e-3
    assert free["routing/agreement"] < 0.05  # the rotation by 3 never equals the natural top-2


def test_dropping_the_sampling_mask_makes_the_mismatch_larger(single):
    assert single["no_mask"][1]["mismatch/logprob_abs_diff"] > 100 * max(single["kept"][1]["mismatch/logprob_abs_diff"], 1e-6)


@pytest.mark.parametrize("name", ["tp2_sp", "pp2", "ep2"])
def test_layouts_match_single_process(name, single, tiny_checkpoint):
    for per_rank in run_ranks(measure, LAYOUTS[name], tiny_checkpoint):
        for case, (grad_norm, metrics) in per_rank.items():
            assert grad_norm == pytest.approx(single[case][0], rel=1e-5), case
            for key, value in metrics.items():
                assert value == pytest.approx(single[case][1][key], abs=1e-5), (case, key)


def replayed_expert_choices(rank, layout, hf_path):
    """Per local MoE layer: (chosen == given for random replay ids, tokens per expert when forced to {1, 5})."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megarl.models.bridge import build_megatron_model
    from megarl.trainer.rl_step import local_replay_indices

    model = build_megatron_model(hf_path, layout, transformer_impl="local", routing_replay=True)
    routers = [m for m in model.chunks[0].modules() if getattr(m, "router_replay", None) is not None]
    chosen = {}
    for router in routers:
        router.register_forward_hook(lambda mod, inp, out: chosen.__setitem__(mod.layer_number, out[1].clone()))
    B, S, L, k, E = 2, 8, 2, 2, 8
    tokens = torch.randint(3, 250, (B, S), generator=torch.Generator().manual_seed(0))
    random_ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(i))[:k]
                              for i in range(B * S * L)]).view(B, S, L, k)
    forced = torch.tensor([1, 5]).expand(B, S, L, k)
    results = []
    for routed in (random_ids, forced):
        RouterReplay.clear_global_indices()
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        RouterReplay.set_replay_data([local_replay_indices(routed, r.layer_number, layout.sequence_parallel)
                                      for r in RouterReplay.global_router_replay_instances])

        def forward_step(data_iterator, m):
            next(data_iterator)
            return m(tokens, torch.arange(S).expand(B, S), None), lambda out: (out.sum(), {})

        with torch.no_grad():
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=model.chunks,
                                        num_microbatches=1, seq_length=S, micro_batch_size=B, forward_only=True)
        per_layer = {}
        for router in routers:
            given = local_replay_indices(routed, router.layer_number, layout.sequence_parallel)
            expected = torch.zeros_like(chosen[router.layer_number]).scatter_(1, given, True)
            per_layer[router.layer_number] = (bool(torch.equal(chosen[router.layer_number], expected)),
                                              chosen[router.layer_number].sum(0).tolist())
        results.append(per_layer)
    RouterReplay.clear_global_router_replay_action()
    local_tokens = B * S // (layout.tp if layout.sequence_parallel else 1)
    return results, local_tokens, parallel_state.get_pipeline_model_parallel_rank()


@pytest.mark.parametrize("name", ["single", "tp2_sp", "ep2", "pp2"])
def test_replay_routes_every_layer_to_the_given_experts(name, tiny_checkpoint):
    layers_seen = set()
    for (random_case, forced_case), local_tokens, _ in run_ranks(replayed_expert_choices, LAYOUTS[name], tiny_checkpoint):
        for layer, (equal, _) in random_case.items():
            assert equal, f"layer {layer}: chosen experts differ from the replayed ones"
            layers_seen.add(layer)
        for layer, (_, counts) in forced_case.items():
            assert counts == [0, local_tokens, 0, 0, 0, local_tokens, 0, 0], (layer, counts)
    assert layers_seen == {1, 2}  # every MoE layer was checked (PP2: one per stage)
