"""Per-GPU memory of a Megatron trainer rank, for each pipeline stage (units: bytes).

Model (Megatron-LM's own accounting, Korthikanti et al. 2022 for activations):

- weights in ``model.dtype``; gradients in fp32 (Megatron accumulates and reduces bf16 models'
  gradients in fp32 ``main_grad`` buffers); Adam state = fp32 master copy (only when the weights
  are not fp32) + two fp32 moments, sharded over the data-parallel ranks by the distributed
  optimizer (dense weights over ``world / (tp * pp)`` ranks, which includes CP; routed experts over
  ``world / (pp * ep * etp)``), and held in host memory with ``optimizer_cpu_offload``.
- dense weights are divided by TP except norms, router and MLA down-projections (replicated);
  routed experts are divided by EP x expert-TP; the embedding sits on the first stage and the
  head on the last, both vocab-parallel over TP.
- activations for one micro-batch of ``max_tokens_per_microbatch`` tokens, split over CP, and
  over TP by sequence parallelism; flash attention (no score matrix). A stage keeps
  ``pp - stage`` micro-batches in flight under 1F1B, times ``1 + (pp-1)/(pp*vpp)`` when
  interleaved. ``full`` recompute keeps only every checkpointed chunk's input plus one chunk's
  activations during its recomputation; ``selective`` drops the SwiGLU intermediates.
- the last stage adds fp32 logits and their gradient, vocab-parallel.
"""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.config.schema import Recompute
from megarl.planner.arch import Arch
from megarl.planner.params import embedding_params, head_params, layer_params
from megarl.planner.units import GIB, dtype_bytes

FP32 = 4


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's per-GPU memory, in bytes (``host_optimizer`` is host memory)."""

    stage: int
    layers: int
    params: int  # parameters held by one GPU of this stage
    weights: int
    grads: int
    optimizer: int
    host_optimizer: int
    activations: int
    reserved: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.reserved


def stage_layers(num_layers: int, pp: int, vpp: int, stage: int) -> list[int]:
    """Decoder layer indices on pipeline ``stage``: ``vpp`` chunks of ``num_layers/(pp*vpp)``,
    chunk ``c`` being virtual stage ``c*pp + stage`` (Megatron's interleaved order)."""
    per_chunk = num_layers // (pp * vpp)
    return [i for c in range(vpp) for i in range((c * pp + stage) * per_chunk, (c * pp + stage + 1) * per_chunk)]


def layer_activation_bytes(arch: Arch, layer: int, tokens: float, dtype_size: int, selective: bool) -> float:
    """Activations one decoder layer keeps for backward, for ``tokens`` tokens on this rank (before
    the TP split), in bytes."""
    h = arch.hidden_size
    if arch.mla:
        heads = arch.num_attention_heads
        qkv = heads * (2 * (arch.qk_nope_head_dim + arch.qk_rope_head_dim) + arch.v_head_dim)
        qkv += arch.q_lora_rank + arch.kv_lora_rank + arch.qk_rope_head_dim  # latent inputs of the up-projections
        attn_out = heads * arch.v_head_dim
    else:
        qkv = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim
        attn_out = arch.num_attention_heads * arch.head_dim
    attention = 2 * h + qkv + attn_out  # norm in, qkv-proj in, core-attention in, out-proj in
    swiglu = 0 if selective else 2  # the activation function's input is recomputed under selective
    if arch.is_moe_layer(layer):
        f = arch.moe_ffn_hidden_size
        per_copy = h + swiglu * f + f  # fc1 in, SwiGLU in, fc2 in of one routed copy
        shared = arch.num_shared_experts * (swiglu * f + f)
        mlp = 2 * h + arch.moe_topk * per_copy + shared  # norm in, router in, k routed copies, shared expert
        router_logits = FP32 * arch.num_experts
    else:
        f = arch.ffn_hidden_size
        mlp = 2 * h + swiglu * f + f
        router_logits = 0
    return tokens * (dtype_size * (attention + mlp) + router_logits)


def _optimizer_bytes_per_param(dtype_size: int) -> int:
    master = 0 if dtype_size == FP32 else FP32
    return master + 2 * FP32  # Adam exp_avg, exp_avg_sq


def stage_memory(arch: Arch, cfg: DictConfig, stage: int) -> StageMemory:
    """Per-GPU memory of one rank on pipeline ``stage`` for the trainer layout of ``cfg``."""
    p, t = cfg.parallel, cfg.trainer
    vpp = p.vpp or 1
    etp = p.etp or p.tp
    size = dtype_bytes(cfg.model.dtype)
    layers = stage_layers(arch.num_layers, p.pp, vpp, stage)
    counts = [layer_params(arch, i) for i in layers]
    dense = sum(c.tp_split for c in counts) / p.tp + sum(c.replicated for c in counts)
    if stage == 0:
        dense += embedding_params(arch) / p.tp
    if stage == p.pp - 1:
        dense += head_params(arch) / p.tp + arch.hidden_size
    experts = sum(c.experts for c in counts) / (p.ep * etp)
    params = dense + experts

    dense_dp = p.world_size // (p.tp * p.pp)
    expert_dp = p.world_size // (p.pp * p.ep * etp)
    opt_per_param = _optimizer_bytes_per_param(size)
    if t.use_distributed_optimizer:
        optimizer = opt_per_param * (dense / dense_dp + experts / expert_dp)
    else:
        optimizer = opt_per_param * params
    host_optimizer = optimizer if t.optimizer_cpu_offload else 0

    activations = _activation_bytes(arch, cfg, stage, layers, size)
    return StageMemory(
        stage=stage, layers=len(layers), params=round(params), weights=round(size * params),
        grads=round(FP32 * params), optimizer=0 if t.optimizer_cpu_offload else round(optimizer),
        host_optimizer=round(host_optimizer), activations=round(activations),
        reserved=round(t.reserved_memory_gb * GIB),
    )


def _activation_bytes(arch: Arch, cfg: DictConfig, stage: int, layers: list[int], size: int) -> float:
    p, t = cfg.parallel, cfg.trainer
    vpp = p.vpp or 1
    tokens = t.max_tokens_per_microbatch / p.cp  # tokens of one micro-batch on this rank, before TP
    in_flight = p.pp - stage
    if p.vpp:
        in_flight *= 1 + (p.pp - 1) / (p.pp * vpp)
    recompute = Recompute(t.recompute)
    per_layer = [layer_activation_bytes(arch, i, tokens, size, recompute == Recompute.selective) for i in layers]
    if recompute == Recompute.full:
        chunk = t.recompute_num_layers or 1
        checkpoints = -(-len(layers) // chunk) * tokens * size * arch.hidden_size
        recomputing = max(sum(per_layer[i:i + chunk]) for i in range(0, len(layers), chunk)) if layers else 0
        kept = checkpoints * in_flight + recomputing
    else:
        kept = sum(per_layer) * in_flight
    kept /= p.tp  # sequence parallel / tensor parallel split every activation over TP
    if stage == p.pp - 1:
        kept += 2 * FP32 * tokens * arch.vocab_size / p.tp  # fp32 logits and their gradient
    return kept


def trainer_memory(arch: Arch, cfg: DictConfig) -> list[StageMemory]:
    """Every pipeline stage's per-GPU memory; the planner checks the largest."""
    return [stage_memory(arch, cfg, s) for s in range(cfg.parallel.pp)]
