"""The experts' load with and without megatron-core's balancing, on a tiny MoE whose routers are
DeepSeek-V3's and GLM-4.5's kind (sigmoid scores, an aux-loss-free expert bias), side by side.

usage: python tools/bench/expert_bias.py [--json FILE] [--steps N] [--rate R] [--aux C] [--lr LR]

One trainer rank in this process (gloo) trains the same RL steps three times from the same random
weights, on batches whose prompts use few distinct tokens (so the routers' choices cluster on some
experts): ``none`` (no balancing), ``expert_bias`` (``moe_router_bias_update_rate`` = ``--rate``: after
each step every expert's bias moves by the rate toward the mean load) and ``aux_loss``
(``moe_aux_loss_coeff`` = ``--aux``). Each step's routes are the routers' own choice (routing not
replayed, as when the engine routes with the weights and bias the trainer synced to it), so the load each
step shows is the one the next rollout would make. Figures per configuration: the routers' load per
step (``experts/trainer/max_over_mean`` of the worst layer, the mean ``entropy`` in units of ln E and
``idle_frac``, :mod:`megarl.metrics.expert_load`) and their means over the first and the last five steps.
:func:`tiny_sigmoid_moe` is the model (``tests/test_replayed_balancing.py`` replays routes on it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from megarl.trainer.micro_batching import MicroBatching

log = logging.getLogger("bench.expert_bias")

LAYERS, EXPERTS, TOPK, VOCAB = 2, 8, 2, 384


def tiny_sigmoid_moe(layout, *, rate: float, aux_coeff: float, lr: float, replay: bool = True):
    """(DDP-wrapped chunks, optimizer, scheduler) of a 2-layer MoE with sigmoid routers, an expert bias updated
    at ``rate`` and the aux loss at ``aux_coeff``, built from megatron-bridge's provider (no checkpoint: the
    bridges of these families map their experts for transformer-engine's grouped layers only), with megarl's
    layout settings and local layers; ``replay``: built with routing replay."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.utils import get_model_config

    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.models import packed_attention
    from megarl.models.bridge import parallel_settings
    from megarl.models.layers import LOCAL_UNFUSED
    from megarl.models.replayed_balancing import count_replayed_routes
    from megarl.trainer.optimizer import build_optimizer

    RouterReplay.clear_global_router_replay_instances()  # a model built before in this process
    provider = GPTModelProvider(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=32, vocab_size=VOCAB,
        seq_length=64, normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
        position_embedding_type="rope", share_embeddings_and_output_weights=False,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=rate,
        moe_router_load_balancing_type="aux_loss", moe_router_dtype="fp32",
        transformer_layer_spec=local_layer_spec, transformer_impl="local", use_cpu_initialization=True,
        **LOCAL_UNFUSED)
    for key, value in parallel_settings(layout, "float32", "alltoall", replay, aux_coeff).items():
        setattr(provider, key, value)
    if replay:
        count_replayed_routes()  # as megarl.models.bridge.build_megatron_model does
    packed_attention.enable()  # packed micro-batches on local layers, as there too
    provider.finalize()
    chunks = provider.provide_distributed_model(
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
        wrap_with_ddp=True, use_cpu_initialization=True)
    get_model_config(chunks[0]).finalize_model_grads_func = finalize_model_grads
    settings = dataclasses.replace(optimizer_settings(default_config(), lr=lr),
                                   use_distributed_optimizer=False)
    return chunks, *build_optimizer(chunks, settings)


def clustered_samples(seed: int, n: int = 32) -> list:
    """``n`` samples of 6-16 tokens drawn from 12 token ids, with random routes (compared, not replayed)."""
    import numpy as np

    from megarl.sample import FinishReason, RolloutSample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt, response = int(rng.integers(4, 9)), int(rng.integers(2, 8))
        tokens = rng.integers(20, 32, prompt + response)
        routes = np.stack([[rng.choice(EXPERTS, TOPK, replace=False) for _ in range(LAYERS)]
                           for _ in range(prompt + response - 1)]).astype(np.int16)
        out.append(RolloutSample(
            prompt_ids=tokens[:prompt].tolist(), response_ids=tokens[prompt:].tolist(),
            loss_mask=np.ones(response, np.uint8), rollout_logprobs=np.full(response, -5.0, np.float32),
            model_version=np.zeros(response, np.int32), routed_experts=routes, sampling_mask=None,
            finish_reason=FinishReason.STOP, advantage=float(rng.normal()), group_id=f"g{i // 4}"))
    return out


def train(name: str, steps: int, rate: float, aux: float, lr: float) -> dict:
    """One configuration's steps from the same seed; its load per step and the means of its first and last five."""
    import torch

    from megarl.algos.settings import AlgorithmConfig
    from megarl.metrics.expert_load import expert_load_metrics
    from megarl.parallel import Layout
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import rl_step

    torch.manual_seed(0)
    chunks, optimizer, scheduler = tiny_sigmoid_moe(Layout(), rate=rate, aux_coeff=aux, lr=lr)
    per_step = []
    for step in range(steps):
        batch = build_rl_batch(clustered_samples(step), with_sampling_mask=False)
        result = rl_step(chunks, optimizer, scheduler, batch, AlgorithmConfig(),
            batching=MicroBatching(max_tokens=512, vocab_size=VOCAB, keep_routing=False, sequence_parallel=False))
        load = result.expert_load
        metrics = expert_load_metrics(load.engine, load.trainer, load.layers)
        per_step.append({k.removeprefix("experts/trainer/"): metrics[k] for k in
                         ("experts/trainer/max_over_mean", "experts/trainer/entropy", "experts/trainer/idle_frac")})
    window = min(5, steps)

    def mean(rows: list[dict]) -> dict:
        return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}

    log.info("%s: max/mean %.2f -> %.2f", name, mean(per_step[:window])["max_over_mean"],
             mean(per_step[-window:])["max_over_mean"])
    return {"rate": rate, "aux_loss_coeff": aux, "lr": lr, "per_step": per_step,
            "first_steps": mean(per_step[:window]), "last_steps": mean(per_step[-window:])}


def run(steps: int, rate: float, aux: float, lr: float) -> dict:
    import torch

    from megarl.parallel import Layout, free_port
    from megarl.trainer.distributed import init_rank

    torch.set_num_threads(1)
    init_rank(0, Layout(), "127.0.0.1", free_port(), backend="gloo")
    configs = {"none": (0.0, 0.0), "expert_bias": (rate, 0.0), "aux_loss": (0.0, aux)}
    result = {"steps": steps, "experts": EXPERTS, "topk": TOPK, "layers": LAYERS}
    for name, (r, a) in configs.items():
        result[name] = train(name, steps, r, a, lr)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rate", type=float, default=0.01, help="moe_router_bias_update_rate of expert_bias")
    parser.add_argument("--aux", type=float, default=0.1, help="moe_aux_loss_coeff of aux_loss")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    from megarl.log import setup_logging

    setup_logging()
    result = run(args.steps, args.rate, args.aux, args.lr)
    for name in ("none", "expert_bias", "aux_loss"):
        first, last = result[name]["first_steps"], result[name]["last_steps"]
        print(f"{name:12s} busiest/mean {first['max_over_mean']:.2f} -> {last['max_over_mean']:.2f}, "
              f"entropy {first['entropy']:.3f} -> {last['entropy']:.3f}, idle {first['idle_frac']:.2f} -> "
              f"{last['idle_frac']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
