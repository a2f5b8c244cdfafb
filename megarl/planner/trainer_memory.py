"""Per-GPU memory of a Megatron trainer rank, for each pipeline stage (units: bytes).

Model (Megatron-LM's own accounting, Korthikanti et al. 2022 for activations):

- weights in ``model.dtype``; gradients in fp32 (Megatron accumulates and reduces bf16 models'
  gradients in fp32 ``main_grad`` buffers); Adam state = fp32 master copy (only when the weights
  are not fp32) + two fp32 moments, sharded over the data-parallel ranks by the distributed
  optimizer (dense weights over ``world / (tp * pp)`` ranks, which includes CP; routed experts over
  ``world / (pp * ep * etp)``), and held in host memory with ``optimizer_cpu_offload``.
- dense weights are divided by TP except norms, router and MLA down-projections (replicated);
  routed experts are divided by EP x expert-TP; the embedding sits on the first stage and the
  head on the last, both vocab-parallel over TP; the decoder layers split over the stages as
  megatron splits them, evenly or with ``parallel.first_stage_layers`` / ``last_stage_layers``
  (megarl/parallel/stages.py).
- activations for one micro-batch of ``max_tokens_per_microbatch`` tokens, split over CP, and
  over TP by sequence parallelism. A stage keeps ``pp - stage`` micro-batches in flight under
  1F1B, times ``1 + (pp-1)/(pp*vpp)`` when interleaved. ``full`` recompute keeps only every
  checkpointed chunk's input, plus either the last stage's head activations (before the backward
  reaches the layers) or one chunk's activations during its recomputation, whichever is larger;
  ``selective`` (megatron's ``core_attn``, and ``moe_act`` where grouped experts run it) drops
  what core attention keeps inside (local: K/V repeated to every head and the softmax
  probabilities; flash attention keeps nothing of size there) and, with fused kernels, each
  routed expert's activation output (fc2's input).
- what a layer keeps depends on the kernels (``model.transformer_impl``): transformer-engine's
  fused ones (``auto``/``transformer_engine``, what GPUs run: flash attention without a score
  matrix, fused RMSNorm and SwiGLU that keep only their inputs), or megatron's ``local`` torch
  layers (CPU), which also keep the normalised inputs, the SwiGLU intermediates, the rotated
  query, K/V repeated to every head and the softmax probabilities ``[heads, s, s]`` of each
  sequence of ``s = rollout.max_prompt_tokens + rollout.max_new_tokens - 1`` positions. The local
  model is the one measured against the live tiny trainer (tests/test_plan_memory.py).
- the last stage adds the final norm's and the output layer's inputs and two fp32 copies of the
  vocab-parallel logits, which the RL log-prob and entropy functions keep for backward.
- with LoRA (``lora.enabled``) the base is frozen: it holds its weights alone, and gradients and
  Adam state are the adapters' (:mod:`megarl.planner.lora`; sharded like the base linears they
  adapt: routed experts' over EP x expert-TP and ``world / (pp * ep * etp)`` data-parallel ranks,
  the rest over TP and ``world / (tp * pp)``); the adapters' weights, in ``model.dtype``, add to the
  base's. Activations are planned as without LoRA: each adapter's rank-wide intermediate adds
  ``rank`` elements a token (about 1% of a Qwen3-30B-A3B layer's at rank 32), not modelled.
- with a critic (``critic.enabled``: PPO's value model, the policy's architecture with a scalar head on the
  same ranks) each stage also holds the critic's weights, gradients and Adam state (``critic``; sharded as
  the policy's, by ``critic.use_distributed_optimizer``, in host memory with ``critic.optimizer_cpu_offload``):
  its last stage has a replicated ``[1, hidden] + 1`` head instead of the vocabulary projection. Its
  activations are not added: the critic runs after the policy's backward, on the same micro-batches, and
  keeps less (no logits).
"""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.config.schema import TransformerImpl
from megarl.parallel import stage_layers
from megarl.planner.arch import Arch
from megarl.planner.lora import adapter_count
from megarl.planner.params import embedding_params, head_params, layer_params
from megarl.planner.units import GIB, dtype_bytes
from megarl.trainer.settings import Recompute

FP32 = 4


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's per-GPU memory, in bytes (``host_optimizer`` is host memory)."""

    stage: int
    layers: int
    params: int  # parameters held by one GPU of this stage (the base model's; with LoRA, frozen)
    weights: int
    grads: int
    optimizer: int
    host_optimizer: int
    activations: int
    reserved: int
    adapter_params: int = 0  # LoRA adapter parameters held by one GPU of this stage (the trained ones)
    critic: int = 0  # the critic's weights, gradients and (on the device) optimizer state on one GPU

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.reserved + self.critic


def layer_activation_bytes(arch: Arch, layer: int, tokens: float, dtype_size: int, selective: bool,
                           fused: bool = True, seq_len: int = 0) -> float:
    """Activations one decoder layer keeps for backward, for ``tokens`` tokens on this rank (before
    the TP split), in bytes. ``fused``: transformer-engine kernels; otherwise megatron's local
    torch layers on sequences of ``seq_len`` positions (see the module docstring)."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    norm = h if fused else 2 * h  # an unfused RMSNorm keeps its input and the normalised input
    if arch.mla:
        qkv = heads * (2 * (arch.qk_nope_head_dim + arch.qk_rope_head_dim) + arch.v_head_dim)
        qkv += arch.q_lora_rank + arch.kv_lora_rank + arch.qk_rope_head_dim  # latent inputs of the up-projections
        attn_out = heads * arch.v_head_dim
        unfused = 0.0  # the local MLA path is not modelled: megarl runs no MLA model on CPU
    else:
        d, groups = arch.head_dim, arch.num_query_groups
        qkv = (heads + 2 * groups) * d
        attn_out = heads * d
        # local: rotated query, K and V repeated to every head (GQA), softmax probabilities;
        # with QK-norm also the normalised query (and its contiguous copy) and key
        repeated = 2 * heads * d if heads > groups else 0
        qk_norm = 2 * heads * d + groups * d if arch.qk_layernorm else 0
        inside_core_attention = repeated + heads * seq_len  # what core_attn recompute drops
        unfused = heads * d + qk_norm + (0 if selective else inside_core_attention)
    attention = norm + h + qkv + attn_out  # norm, qkv-proj in, core-attention in, out-proj in
    if not fused:
        attention += unfused
    # SwiGLU (in units of f): its input [2f]; unfused also silu(gate) and the shifted linear half,
    # and in a routed expert the product before the routing-probability scale; then fc2's input
    # [f], which selective recompute (moe_act, fused grouped experts only) drops in routed experts
    glu = 2 + (0 if fused else 2)
    routed_glu = glu + (0 if fused else 1)
    if arch.is_moe_layer(layer):
        f = arch.moe_ffn_hidden_size
        per_copy = h + routed_glu * f + (0 if selective and fused else f)  # fc1 in, SwiGLU, fc2 in of one routed copy
        shared = arch.num_shared_experts * (glu * f + f)
        mlp = norm + h + arch.moe_topk * per_copy + shared  # norm, router in, k routed copies, shared expert
        router_logits = FP32 * arch.num_experts
    else:
        f = arch.ffn_hidden_size
        mlp = norm + h + glu * f + f  # norm, fc1 in, SwiGLU, fc2 in
        router_logits = 0
    return tokens * (dtype_size * (attention + mlp) + router_logits)


def head_activation_bytes(arch: Arch, tokens: float, dtype_size: int, fused: bool) -> float:
    """The last stage's extra activations for ``tokens`` tokens (before the TP split), in bytes:
    the final norm's and the output layer's inputs and two fp32 copies of the logits."""
    norm = arch.hidden_size if fused else 2 * arch.hidden_size
    return tokens * (dtype_size * (norm + arch.hidden_size) + 2 * FP32 * arch.vocab_size)


def _optimizer_bytes_per_param(dtype_size: int) -> int:
    master = 0 if dtype_size == FP32 else FP32
    return master + 2 * FP32  # Adam exp_avg, exp_avg_sq


def _stage_params(arch: Arch, p: DictConfig, stage: int, layers: list[int], head: float) -> tuple[float, float]:
    """(dense, routed-expert) parameters one GPU of pipeline ``stage`` holds; ``head``: those of the output
    layer on the last stage (besides the final norm)."""
    counts = [layer_params(arch, i) for i in layers]
    dense = sum(c.tp_split for c in counts) / p.tp + sum(c.replicated for c in counts)
    if stage == 0:
        dense += embedding_params(arch) / p.tp
    if stage == p.pp - 1:
        dense += head + arch.hidden_size
    return dense, sum(c.experts for c in counts) / (p.ep * (p.etp or p.tp))


def _optimizer_state_bytes(p: DictConfig, distributed: bool, dense: float, experts: float, size: int) -> float:
    """Adam state of ``dense`` and routed-expert trained parameters on one GPU (``distributed``: sharded over
    the data-parallel ranks by the distributed optimizer)."""
    per_param = _optimizer_bytes_per_param(size)
    if not distributed:
        return per_param * (dense + experts)
    dense_dp = p.world_size // (p.tp * p.pp)
    expert_dp = p.world_size // (p.pp * p.ep * (p.etp or p.tp))
    return per_param * (dense / dense_dp + experts / expert_dp)


def critic_bytes(arch: Arch, cfg: DictConfig, stage: int, layers: list[int]) -> tuple[float, float]:
    """(device, host) bytes of the critic on one GPU of ``stage``: weights, fp32 gradients and Adam state
    (the latter in host memory with ``critic.optimizer_cpu_offload``); (0, 0) without a critic."""
    c = cfg.critic
    if not c.enabled:
        return 0.0, 0.0
    size = dtype_bytes(cfg.model.dtype)
    dense, experts = _stage_params(arch, cfg.parallel, stage, layers, head=arch.hidden_size + 1)
    optimizer = _optimizer_state_bytes(cfg.parallel, c.use_distributed_optimizer, dense, experts, size)
    on_device = (size + FP32) * (dense + experts) + (0 if c.optimizer_cpu_offload else optimizer)
    return on_device, optimizer if c.optimizer_cpu_offload else 0.0


def stage_memory(arch: Arch, cfg: DictConfig, stage: int) -> StageMemory:
    """Per-GPU memory of one rank on pipeline ``stage`` for the trainer layout of ``cfg``."""
    p, t = cfg.parallel, cfg.trainer
    size = dtype_bytes(cfg.model.dtype)
    layers = stage_layers(arch.num_layers, p.pp, p.vpp or 1, stage, p.first_stage_layers, p.last_stage_layers)
    dense, experts = _stage_params(arch, p, stage, layers, head=head_params(arch) / p.tp)
    params = dense + experts
    lora = cfg.enabled_lora
    if lora is not None:  # the base is frozen: only the adapters have gradients and optimizer state
        adapters = adapter_count(arch, lora, layers)
        dense, experts = adapters.tp_split / p.tp, adapters.experts / (p.ep * (p.etp or p.tp))
    trained = dense + experts
    optimizer = _optimizer_state_bytes(p, t.use_distributed_optimizer, dense, experts, size)
    host_optimizer = optimizer if t.optimizer_cpu_offload else 0
    critic, critic_host = critic_bytes(arch, cfg, stage, layers)

    activations = _activation_bytes(arch, cfg, stage, layers, size)
    adapter_params = trained if lora is not None else 0
    return StageMemory(
        stage=stage, layers=len(layers), params=round(params), weights=round(size * (params + adapter_params)),
        grads=round(FP32 * trained), optimizer=0 if t.optimizer_cpu_offload else round(optimizer),
        host_optimizer=round(host_optimizer + critic_host), activations=round(activations),
        reserved=round(t.reserved_memory_gb * GIB), adapter_params=round(adapter_params), critic=round(critic),
    )


def _activation_bytes(arch: Arch, cfg: DictConfig, stage: int, layers: list[int], size: int) -> float:
    p, t = cfg.parallel, cfg.trainer
    vpp = p.vpp or 1
    tokens = t.max_tokens_per_microbatch / p.cp  # tokens of one micro-batch on this rank, before TP
    fused = TransformerImpl(cfg.model.transformer_impl) != TransformerImpl.local
    seq_len = min(cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens - 1, t.max_tokens_per_microbatch)
    in_flight = p.pp - stage
    if p.vpp:
        in_flight *= 1 + (p.pp - 1) / (p.pp * vpp)
    recompute = Recompute(t.recompute)
    per_layer = [layer_activation_bytes(arch, i, tokens, size, recompute == Recompute.selective, fused, seq_len)
                 for i in layers]
    if recompute == Recompute.full:
        chunk = t.recompute_num_layers or 1
        checkpoints = -(-len(layers) // chunk) * tokens * size * arch.hidden_size
        recomputing = max(sum(per_layer[i:i + chunk]) for i in range(0, len(layers), chunk)) if layers else 0
        head = head_activation_bytes(arch, tokens, size, fused) if stage == p.pp - 1 else 0
        kept = checkpoints * in_flight + max(recomputing, head)
    else:
        kept = sum(per_layer) * in_flight
        if stage == p.pp - 1:
            kept += head_activation_bytes(arch, tokens, size, fused)
    return kept / p.tp  # sequence parallel / tensor parallel split every activation over TP


def trainer_memory(arch: Arch, cfg: DictConfig) -> list[StageMemory]:
    """Every pipeline stage's per-GPU memory; the planner checks the largest."""
    return [stage_memory(arch, cfg, s) for s in range(cfg.parallel.pp)]
