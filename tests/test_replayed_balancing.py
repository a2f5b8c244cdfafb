"""megatron-core's load balancing under Keep Routing (megarl/models/replayed_balancing.py, the padding mask of
megarl/trainer/routing_replay.py): on a tiny MoE with sigmoid routers, an aux-loss-free expert bias and an aux
loss (DeepSeek-V3's and GLM-4.5's kind of router), one RL step replaying routes the routers would not choose,
in padded micro-batches:

- the expert bias after the step equals megatron-core's own update (``get_updated_expert_bias``) on the
  routing map of the replayed routes of the step's tokens, padding left out;
- the aux loss's tokens per expert are the replayed routes' too (megatron's own top-k would count others);
- the bias reaches the engine with the weights: megatron-bridge's DeepSeek-V3 mapping exports the router's
  ``expert_bias`` as HF's ``e_score_correction_bias``, the gate parameter SGLang's DeepSeek-V2/V3 model loads.

The model is tools/bench/expert_bias.py's, built from megatron-bridge's provider directly (the bridges of these
families map their experts for transformer-engine's grouped layers only, which this CPU machine has not).
"""
import sys
from pathlib import Path

import pytest

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools" / "bench"))  # last: bench/agents.py is no SDK
from expert_bias import EXPERTS, LAYERS, TOPK  # noqa: E402

from megarl.trainer.micro_batching import MicroBatching

RATE = 0.01


def samples_off_the_router(seed):
    """Eight samples of 5-14 tokens whose routes are random expert pairs (not what the routers would choose)."""
    import numpy as np

    from megarl.sample import FinishReason, RolloutSample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(8):
        prompt, response = int(rng.integers(3, 7)), int(rng.integers(2, 8))
        routes = np.stack([[rng.choice(EXPERTS, TOPK, replace=False) for _ in range(LAYERS)]
                           for _ in range(prompt + response - 1)]).astype(np.int16)
        out.append(RolloutSample(
            prompt_ids=rng.integers(3, 300, prompt).tolist(), response_ids=rng.integers(3, 300, response).tolist(),
            loss_mask=np.ones(response, np.uint8), rollout_logprobs=np.full(response, -5.0, np.float32),
            model_version=np.zeros(response, np.int32), routed_experts=routes, sampling_mask=None,
            finish_reason=FinishReason.STOP, advantage=float(rng.normal()), group_id=f"g{i // 4}"))
    return out


def balancing_step(rank, layout):
    """(expert bias before, after, what megatron-core's update gives on the replayed routes' map, the aux
    loss's tokens per expert and layer, the replayed routes' count, the routers' own count) of one RL step, and
    the HF name the bridge exports a router's expert bias as."""
    import torch
    from expert_bias import tiny_sigmoid_moe
    from megatron.core.transformer.moe import router as megatron_router
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    from megarl.algos.settings import AlgorithmConfig
    from megarl.metrics.expert_load import route_counts
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import rl_step

    chunks, optimizer, scheduler = tiny_sigmoid_moe(layout, rate=RATE, aux_coeff=0.01, lr=0.0)
    routers = [m for m in chunks[0].modules() if getattr(m, "expert_bias", None) is not None]
    with torch.no_grad():
        for router in routers:  # a bias already moved, as a checkpoint's e_score_correction_bias would be
            router.expert_bias.copy_(torch.linspace(-0.05, 0.05, EXPERTS))
    before = torch.stack([r.expert_bias.clone() for r in routers])
    aux_counts = []
    counted = megatron_router.get_tokens_per_expert_and_token_count

    def spy(routing_map, *args, **kwargs):
        aux_counts.append(routing_map.sum(0).double())
        return counted(routing_map, *args, **kwargs)

    samples = samples_off_the_router(0)
    megatron_router.get_tokens_per_expert_and_token_count = spy
    try:
        result = rl_step(chunks, optimizer, scheduler, build_rl_batch(samples, with_sampling_mask=False),
                         AlgorithmConfig(), MicroBatching(max_tokens=40, vocab_size=384, keep_routing=True,
                                                          sequence_parallel=layout.sequence_parallel, pack=False))
    finally:
        megatron_router.get_tokens_per_expert_and_token_count = counted
    replayed = torch.from_numpy(route_counts([s.routed_experts for s in samples], EXPERTS)).double()
    expected = get_updated_expert_bias(replayed.float().clone(), before.clone(), RATE)
    aux = torch.stack([sum(aux_counts[layer::LAYERS]) for layer in range(LAYERS)])
    after = torch.stack([r.expert_bias.clone() for r in routers])
    return (before, after, expected, aux, replayed, torch.from_numpy(result.expert_load.trainer),
            exported_bias_name("decoder.layers.3.mlp.router.expert_bias"))


def exported_bias_name(megatron_name):
    """The HF name megatron-bridge's DeepSeek-V3 mapping exports ``megatron_name`` as."""
    from megarl.models.bridge_registry import auto_bridge_for
    from megarl.platform import megatron_cpu

    megatron_cpu.apply()
    auto_bridge_for(["DeepseekV3ForCausalLM"])
    from megatron.bridge.models.deepseek.deepseek_v3_bridge import DeepSeekV3Bridge

    return DeepSeekV3Bridge().mapping_registry().megatron_to_hf_lookup(megatron_name).hf_param


@pytest.fixture(scope="module")
def step(ray_local):
    """The step on one rank, on the test process's Ray (conftest)."""
    return run_ranks(balancing_step, Layout())[0]


def test_the_expert_bias_update_equals_megatron_cores_on_the_replayed_routes(step):
    before, after, expected, *_ = step
    assert not (after == before).all()  # the bias moved by its rate, one sign step per expert
    assert ((after - before).abs() <= 0.01 + 1e-7).all()
    assert (after == expected).all(), (after, expected)


def test_the_aux_loss_counts_the_replayed_routes_not_its_own_top_k(step):
    _, _, _, aux, replayed, own, _ = step
    assert (aux == replayed).all(), (aux, replayed)
    assert not (own == replayed).all()  # the routers' own choice on the same tokens (what megatron would count)



def test_the_bias_reaches_the_engine_as_e_score_correction_bias(step):
    assert step[-1] == "model.layers.3.mlp.gate.e_score_correction_bias"
