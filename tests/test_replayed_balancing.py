"""megatron-core's load balancing under Keep Routing (megarl/models/replayed_balancing.py, the padding mask of
megarl/trainer/routing_replay.py): on a tiny MoE with sigmoid routers, an aux-loss-free expert bias and an aux
loss (DeepSeek-V3's and GLM-4.5's kind of router), one RL step replaying routes the routers would not choose,
in padded micro-batches:

- the expert bias after the step equals megatron-core's own update (``get_updated_expert_bias``) on the
  routing map of the replayed routes of the step's tokens, padding left out;
- the aux loss's tokens per expert are the replayed routes' too (megatron's own top-k would count others).

The model is built from megatron-bridge's provider directly (the bridges of these families map their experts
for transformer-engine's grouped layers only, which this CPU machine has not).
"""
import pytest

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray (conftest)

LAYERS, EXPERTS, TOPK, RATE = 2, 8, 2, 0.01


def tiny_sigmoid_moe(layout):
    """A DDP-wrapped 2-layer MoE with sigmoid routers, expert bias and aux loss, replaying routes, with its
    optimizer at lr 0 (the weights stay; the bias is megatron's buffer, updated after the backward)."""
    import dataclasses

    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import get_model_config

    from megarl.config import default_config
    from megarl.models.bridge import parallel_settings
    from megarl.models.layers import LOCAL_UNFUSED
    from megarl.models.replayed_balancing import count_replayed_routes
    from megarl.trainer.optimizer import OptimizerSettings, build_optimizer

    provider = GPTModelProvider(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=32, vocab_size=384,
        seq_length=64, normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
        position_embedding_type="rope", share_embeddings_and_output_weights=False,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=RATE,
        moe_router_load_balancing_type="aux_loss", moe_router_dtype="fp32",
        transformer_layer_spec=local_layer_spec, transformer_impl="local", use_cpu_initialization=True,
        **LOCAL_UNFUSED)
    for key, value in parallel_settings(layout, "float32", "alltoall", True, 0.01).items():
        setattr(provider, key, value)
    count_replayed_routes()  # what build_megatron_model installs with routing_replay
    provider.finalize()
    chunks = provider.provide_distributed_model(
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
        wrap_with_ddp=True, use_cpu_initialization=True)
    get_model_config(chunks[0]).finalize_model_grads_func = finalize_model_grads
    settings = dataclasses.replace(OptimizerSettings.from_config(default_config(), lr=0.0),
                                   use_distributed_optimizer=False)
    return chunks, *build_optimizer(chunks, settings)


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
    loss's tokens per expert and layer, the replayed routes' count, the routers' own count) of one RL step."""
    import torch
    from megatron.core.transformer.moe import router as megatron_router
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    from megarl.config.schema import AlgorithmConfig
    from megarl.metrics.expert_load import route_counts
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import rl_step

    chunks, optimizer, scheduler = tiny_sigmoid_moe(layout)
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
                         AlgorithmConfig(), vocab_size=384, max_tokens_per_microbatch=40, keep_routing=True,
                         sequence_parallel=layout.sequence_parallel, pack=False)
    finally:
        megatron_router.get_tokens_per_expert_and_token_count = counted
    replayed = torch.from_numpy(route_counts([s.routed_experts for s in samples], EXPERTS)).double()
    expected = get_updated_expert_bias(replayed.float().clone(), before.clone(), RATE)
    aux = torch.stack([sum(aux_counts[layer::LAYERS]) for layer in range(LAYERS)])
    after = torch.stack([r.expert_bias.clone() for r in routers])
    return before, after, expected, aux, replayed, torch.from_numpy(result.expert_load.trainer)


@pytest.fixture(scope="module")
def step():
    return run_ranks(balancing_step, Layout())[0]


def test_the_expert_bias_update_equals_megatron_cores_on_the_replayed_routes(step):
    before, after, expected, _, replayed, _ = step
    assert not (after == before).all()  # the bias moved by its rate, one sign step per expert
    assert ((after - before).abs() <= 0.01 + 1e-7).all()
    assert (after == expected).all(), (after, expected)


def test_the_aux_loss_counts_the_replayed_routes_not_its_own_top_k(step):
    _, _, _, aux, replayed, own = step
    assert (aux == replayed).all(), (aux, replayed)
    assert not (own == replayed).all()  # the routers' own choice on the same tokens (what megatron would count)
