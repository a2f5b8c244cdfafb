"""The Megatron trainer under every parallel layout, against one process and against HF.

One process per rank runs, on the tiny MoE built through megatron-bridge:
- two supervised steps (forward, backward, DistributedOptimizer update) on a fixed batch;
- RL steps on a frozen copy (lr=0) with samples whose rollout log-probs come from HF transformers,
  renormalised over each position's top-k set, under the routing HF used: with Keep Routing and Keep
  Sampling Mask the trainer reproduces them; a forced, different routing is reproduced too when
  replayed and not when it is not; without the mask the mismatch is large;
- a router hook check that replay makes every MoE layer choose exactly the given experts.
Every layout's losses, gradient norms and metrics equal the single-process run within 1e-5.
"""
import dataclasses

import pytest

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks
from megarl.trainer.micro_batching import MicroBatching

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)

LAYOUTS = {
    "tp2_sp": Layout(world_size=2, tp=2, sequence_parallel=True),
    "ep2": Layout(world_size=2, ep=2),
    "pp2": Layout(world_size=2, pp=2),
    "dp2": Layout(world_size=2),
    "tp2_ep2": Layout(world_size=4, tp=2, ep=2, sequence_parallel=True),
    # a later pipeline stage's MoE routers get their sequence slice of the padding mask (routing_replay.padding_mask)
    "pp2_tp2_sp": Layout(world_size=4, tp=2, pp=2, sequence_parallel=True),
}


def supervised_steps(layout, hf_path):
    """[(loss or None off the last PP stage, grad_norm)] of two steps."""
    import torch
    from megatron.core import parallel_state

    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.trainer.model_setup import ModelSettings, build_trainable
    from megarl.trainer.sft_step import supervised_step
    from megarl.trainer.token_batch import token_batch

    trainable = build_trainable(hf_path, layout, optimizer_settings(default_config(), lr=1e-3),
                                ModelSettings(transformer_impl="local"))
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 12, (8,), generator=gen).tolist()
    batch = token_batch([torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths], [2] * 8)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    out = []
    for pack in (True, False):  # 8 sequences of 4-11 tokens over a 40-token budget: several micro-batches
        result = supervised_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, 40, pack=pack)
        out.append((result.loss if last else None, result.grad_norm))
    return out


def rl_cases(trainable, layout, hf, loads):
    """{case: (grad_norm, metrics)} of rl_step on the frozen model (with the expert-load metrics); ``loads`` gets
    each case's expert load (engine's, trainer's) counts."""
    from hf_oracle import make_samples

    from megarl.algos.settings import AlgorithmConfig
    from megarl.pipeline.bookkeeping import load_metrics
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import rl_step

    natural = make_samples(hf, 8, top_k=5, seed=1)
    forced = make_samples(hf, 8, top_k=5, seed=1, rotate_experts=3)

    def step(case, samples, keep_routing=True, keep_mask=True, pack=True):
        batch = build_rl_batch(samples, with_sampling_mask=keep_mask)
        result = rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, AlgorithmConfig(),
                         batching=MicroBatching(max_tokens=24, vocab_size=hf.config.vocab_size,
                                                keep_routing=keep_routing, sequence_parallel=layout.sequence_parallel,
                                                pack=pack))
        loads[case] = (result.expert_load.engine, result.expert_load.trainer)
        metrics = {k: v for k, v in result.metrics.items() if not k.startswith("perf/")} | load_metrics(result)
        return case, (result.grad_norm, metrics)

    return dict([step("kept", natural), step("forced_kept", forced), step("forced_free", forced, keep_routing=False),
                 step("no_mask", natural, keep_mask=False), step("padded", natural, pack=False)])


def packing_diffs(trainable, layout, hf):
    """{keep_routing: (loss diff, max gradient diff, max per-token log-prob diff, tokens compared)}
    between packed and padded micro-batches of the same samples on the frozen model."""
    import torch
    from hf_oracle import make_samples

    from megarl.algos.settings import AlgorithmConfig
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import local_micro_batches, reference_logprobs, rl_step

    batch = build_rl_batch(make_samples(hf, 8, top_k=5, seed=2))
    out = {}
    for keep in (True, False):
        runs = {}
        for pack in (False, True):
            result = rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, AlgorithmConfig(),
                             batching=MicroBatching(max_tokens=24, vocab_size=hf.config.vocab_size, keep_routing=keep,
                                                    sequence_parallel=layout.sequence_parallel, pack=pack))
            grads = torch.cat([p.main_grad.flatten().clone() for c in trainable.chunks for p in c.parameters()])
            plan, dp_rank, micro = local_micro_batches(
                batch, MicroBatching(max_tokens=24, sequence_parallel=layout.sequence_parallel, pack=pack))
            logprobs = reference_logprobs(trainable.chunks, micro, vocab_size=hf.config.vocab_size, temperature=1.0,
                                          replay=keep, sequence_parallel=layout.sequence_parallel)
            per_sample = {}
            for indices, (mb, _), lp in zip(plan.per_rank[dp_rank], micro, logprobs):
                if lp is not None:
                    per_sample.update(zip(indices, lp.split(mb.lengths.tolist())))
            runs[pack] = (result.metrics.get("loss"), grads, per_sample)
        (loss_a, grads_a, lp_a), (loss_b, grads_b, lp_b) = runs[False], runs[True]
        common = sorted(set(lp_a) & set(lp_b))
        lp_diff = max((float((lp_a[i] - lp_b[i]).abs().max()) for i in common), default=0.0)
        out[keep] = (None if loss_a is None else abs(loss_a - loss_b), float((grads_a - grads_b).abs().max()),
                     lp_diff, sum(len(lp_a[i]) for i in common))
    return out


def replay_choices(chunks, layout):
    """[(per layer: chosen == given, tokens per expert)] for random replay ids and for all tokens -> {1, 5}."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megarl.trainer.routing_replay import local_replay_indices

    routers = [m for m in chunks[0].modules() if getattr(m, "router_replay", None) is not None]
    chosen = {}
    for router in routers:
        router.register_forward_hook(lambda mod, inp, out: chosen.__setitem__(mod.layer_number, out[1].clone()))
    B, S, L, k, E = 2, 8, 2, 2, 8
    tokens = torch.randint(3, 250, (B, S), generator=torch.Generator().manual_seed(0))
    random_ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(i))[:k]
                              for i in range(B * S * L)]).view(B, S, L, k)
    results = []
    for routed in (random_ids, torch.tensor([1, 5]).expand(B, S, L, k)):
        RouterReplay.clear_global_indices()
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        RouterReplay.set_replay_data([local_replay_indices(routed, r.layer_number, layout.sequence_parallel)
                                      for r in RouterReplay.global_router_replay_instances])

        def forward_step(data_iterator, model):
            next(data_iterator)
            return model(tokens, torch.arange(S).expand(B, S), None), lambda out: (out.sum(), {})

        with torch.no_grad():
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=chunks,
                                        num_microbatches=1, seq_length=S, micro_batch_size=B, forward_only=True)
        per_layer = {}
        for router in routers:
            given = local_replay_indices(routed, router.layer_number, layout.sequence_parallel)
            expected = torch.zeros_like(chosen[router.layer_number]).scatter_(1, given, True)
            per_layer[router.layer_number] = (bool(torch.equal(chosen[router.layer_number], expected)),
                                              chosen[router.layer_number].sum(0).tolist())
        results.append(per_layer)
    RouterReplay.clear_global_router_replay_action()
    return results


def layout_checks(rank, layout, hf_path):
    from hf_oracle import load_hf
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.trainer.model_setup import ModelSettings, build_trainable

    sft = supervised_steps(layout, hf_path)
    RouterReplay.clear_global_router_replay_instances()
    # lr 0; a plain DDP all-reduce (no distributed optimizer) leaves every DP rank the whole reduced
    # gradient, which packing_diffs compares
    frozen_settings = dataclasses.replace(optimizer_settings(default_config(), lr=0.0),
                                          use_distributed_optimizer=False)
    frozen = build_trainable(hf_path, layout, frozen_settings,
                             ModelSettings(transformer_impl="local", routing_replay=True))
    hf = load_hf(hf_path)
    loads = {}
    rl = rl_cases(frozen, layout, hf, loads)
    packing = packing_diffs(frozen, layout, hf)
    local_tokens = 16 // (layout.tp if layout.sequence_parallel else 1)
    return {"sft": sft, "rl": rl, "replay": replay_choices(frozen.chunks, layout), "local_tokens": local_tokens,
            "packing": packing, "load": loads}


@pytest.fixture(scope="module")
def single(tiny_checkpoint):
    return run_ranks(layout_checks, Layout(), tiny_checkpoint)[0]


def test_supervised_update_lowers_the_loss(single):
    (loss0, grad_norm0), (loss1, _) = single["sft"]
    assert loss1 < loss0 and grad_norm0 > 0


def test_keep_routing_and_mask_reproduce_rollout_logprobs(single):
    grad_norm, kept = single["rl"]["kept"]
    assert kept["mismatch/logprob_abs_diff"] < 1e-5  # so the PPO ratio is 1 within 1e-5
    assert abs(kept["mismatch/kl"]) < 1e-5
    assert kept["clip_fraction"] == 0.0 and grad_norm > 0
    assert kept["routing/agreement"] > 0.99  # measured beside the replay: the trainer's router agrees


def test_agreement_under_replay_shows_routing_the_trainer_would_not_choose(single):
    forced = single["rl"]["forced_kept"][1]
    assert forced["mismatch/logprob_abs_diff"] < 1e-5  # replayed, so the log-probs still match
    assert forced["routing/agreement"] < 0.05  # but the trainer's own top-2 is never the rotated one


def test_replayed_routing_is_the_one_used(single):
    assert single["rl"]["forced_kept"][1]["mismatch/logprob_abs_diff"] < 1e-5
    free = single["rl"]["forced_free"][1]
    assert free["mismatch/logprob_abs_diff"] > 1e-3
    assert free["routing/agreement"] < 0.05  # the rotation by 3 never equals the natural top-2


def test_dropping_the_sampling_mask_makes_the_mismatch_larger(single):
    kept = single["rl"]["kept"][1]["mismatch/logprob_abs_diff"]
    assert single["rl"]["no_mask"][1]["mismatch/logprob_abs_diff"] > 100 * max(kept, 1e-6)


def test_expert_load_is_the_count_of_the_steps_routes(single, tiny_checkpoint):
    """The engine's side equals a direct count over the samples' routes, padding left out; the trainer's
    router on the same tokens picks HF's natural experts (beside the replay of a rotation too, in layer 1,
    whose input the rotation does not change)."""
    from hf_oracle import load_hf, make_samples

    from megarl.metrics.expert_load import expert_load_metrics, route_counts

    hf = load_hf(tiny_checkpoint)
    natural = route_counts([s.routed_experts for s in make_samples(hf, 8, top_k=5, seed=1)], 8)
    forced = route_counts([s.routed_experts for s in make_samples(hf, 8, top_k=5, seed=1, rotate_experts=3)], 8)
    load = single["load"]
    for case, routes in (("kept", natural), ("padded", natural), ("no_mask", natural), ("forced_kept", forced),
                         ("forced_free", forced)):
        assert (load[case][0] == routes).all(), case
        metrics = single["rl"][case][1]
        assert {k: v for k, v in metrics.items() if k.startswith("experts/")} == \
            pytest.approx(expert_load_metrics(load[case][0], load[case][1], [1, 2])), case
    assert (natural.sum(1) == natural.sum() / 2).all() and natural.sum() == 2 * 2 * sum(
        len(s.prompt_ids) + len(s.response_ids) - 1 for s in make_samples(hf, 8, top_k=5, seed=1))
    assert single["rl"]["kept"][1]["experts/load_tv"] < 0.02  # the trainer's router agrees with HF's
    assert single["rl"]["forced_kept"][1]["experts/L1/load_tv"] > 0.1  # the rotation moves the load
    assert abs(load["forced_kept"][1][0] - natural[0]).sum() <= 0.02 * natural[0].sum()
    assert abs(load["forced_free"][1][0] - natural[0]).sum() <= 0.02 * natural[0].sum()


def check_replay(result):
    layers = set()
    random_case, forced_case = result["replay"]
    for layer, (equal, _) in random_case.items():
        assert equal, f"layer {layer}: chosen experts differ from the replayed ones"
        layers.add(layer)
    n = result["local_tokens"]
    for layer, (_, counts) in forced_case.items():
        assert counts == [0, n, 0, 0, 0, n, 0, 0], (layer, counts)
    return layers


def check_packing(result):
    """Packed and padded micro-batches of the same samples: same loss, gradients, log-probs."""
    compared = 0
    for keep_routing, (loss_diff, grad_diff, logprob_diff, tokens) in result["packing"].items():
        assert loss_diff is None or loss_diff < 1e-5, (keep_routing, loss_diff)
        assert grad_diff < 1e-5, (keep_routing, grad_diff)
        assert logprob_diff < 1e-5, (keep_routing, logprob_diff)
        compared += tokens
    return compared


def test_packed_equals_padded(single):
    assert check_packing(single) > 0  # per-token log-probs were compared
    assert single["rl"]["padded"][1]["loss"] == pytest.approx(single["rl"]["kept"][1]["loss"], abs=1e-5)


def test_replay_routes_every_layer_to_the_given_experts(single):
    assert check_replay(single) == {1, 2}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_equals_single_process(name, single, tiny_checkpoint):
    per_rank = run_ranks(layout_checks, LAYOUTS[name], tiny_checkpoint)
    assert any(r["sft"][0][0] is not None for r in per_rank), "no rank reported a loss"
    layers = set()
    for result in per_rank:
        for (loss, grad_norm), (ref_loss, ref_grad_norm) in zip(result["sft"], single["sft"]):
            assert grad_norm == pytest.approx(ref_grad_norm, abs=1e-5)
            if loss is not None:
                assert loss == pytest.approx(ref_loss, abs=1e-5)
        for case, (grad_norm, metrics) in result["rl"].items():
            assert grad_norm == pytest.approx(single["rl"][case][0], abs=1e-5), case
            experts = {k for k in single["rl"][case][1] if k.startswith("experts/")}
            assert experts and experts <= metrics.keys(), case  # every rank has the whole step's load
            for key, value in metrics.items():  # relative for the metrics far from 1 (perplexities ~400)
                assert value == pytest.approx(single["rl"][case][1][key], abs=1e-5, rel=1e-6), (case, key)
            for mine, ref in zip(result["load"][case], single["load"][case]):  # every rank: the whole step's
                assert (mine == ref).all(), case
        layers |= check_replay(result)
        check_packing(result)
    assert layers == {1, 2}  # every MoE layer checked (PP2: one per stage)


def reference_kl_checks(rank, layout, hf_path):
    """[(sum of sequence_kl, rl_step's KL metric, trained tokens)] over three steps with a reference."""
    from hf_oracle import load_hf, make_samples

    from megarl.algos.settings import AlgorithmConfig
    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.trainer.model_setup import ModelSettings, build_trainable
    from megarl.trainer.reference import ReferenceWeights
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import rl_step, sequence_kl

    hf = load_hf(hf_path)
    trainable = build_trainable(hf_path, layout, optimizer_settings(default_config(), lr=1e-2),
                                ModelSettings(transformer_impl="local", routing_replay=True))
    reference = ReferenceWeights(trainable.chunks)
    algo = AlgorithmConfig(kl_coef=0.1, kl_type="k3")
    batching = MicroBatching(max_tokens=24, vocab_size=hf.config.vocab_size, keep_routing=True,
                             sequence_parallel=layout.sequence_parallel)
    out = []
    for step in range(3):
        batch = build_rl_batch(make_samples(hf, 8, top_k=5, seed=10 + step))
        per_sample = sequence_kl(trainable.chunks, batch, algo.kl_type, reference, batching)
        result = rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, algo, batching,
                         reference=reference)
        out.append((sum(per_sample), result.metrics["kl"], float(batch.loss_mask.sum())))
    return out


def test_reference_kl_is_zero_at_the_start_and_grows(tiny_checkpoint):
    """The KL to the reference (the starting weights): 0 at the first step, positive once the policy
    moved; the loss's token-mean KL equals the per-sample sums of sequence_kl (kl_in_reward's
    penalty) over the same tokens, computed by the other path."""
    steps = run_ranks(reference_kl_checks, Layout(), tiny_checkpoint)[0]
    (first_sum, first_metric, _), *later = steps
    assert abs(first_sum) < 1e-9 and abs(first_metric) < 1e-9
    for total, metric, tokens in later:
        assert metric > 0 and total / tokens == pytest.approx(metric, rel=1e-4)
