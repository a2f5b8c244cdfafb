"""Parameter counts of a MoE decoder, per layer and in total (units: parameters, i.e. elements).

The counts follow the HF checkpoint's tensors (q/k/v/o, MLA down/up projections, norms, router,
the sigmoid routers' score-correction bias, routed and shared experts, embedding, head). Each
layer's count is split the way Megatron shards it: ``tp_split`` (column/row parallel and
vocab-parallel weights, divided by tensor parallelism), ``replicated`` (norms, router, MLA
down-projections: a full copy on every TP rank) and ``experts`` (routed experts, divided by
expert parallelism x expert tensor parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.planner.arch import Arch


@dataclass(frozen=True)
class ShardedCount:
    """A parameter count split by how Megatron shards it (all in parameters)."""

    tp_split: int = 0
    replicated: int = 0
    experts: int = 0

    @property
    def total(self) -> int:
        return self.tp_split + self.replicated + self.experts

    def __add__(self, other: "ShardedCount") -> "ShardedCount":
        return ShardedCount(self.tp_split + other.tp_split, self.replicated + other.replicated,
                            self.experts + other.experts)


def attention_params(arch: Arch) -> ShardedCount:
    """One layer's attention block, including its input RMSNorm."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    if arch.mla:
        qk_head = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        if arch.q_lora_rank:
            q_down = h * arch.q_lora_rank + arch.q_lora_rank  # q_a_proj + q_a_layernorm
            q_up = arch.q_lora_rank * heads * qk_head  # q_b_proj
        else:
            q_down, q_up = 0, h * heads * qk_head
        kv_down = h * (arch.kv_lora_rank + arch.qk_rope_head_dim) + arch.kv_lora_rank  # kv_a_proj (+ norm)
        kv_up = arch.kv_lora_rank * heads * (arch.qk_nope_head_dim + arch.v_head_dim)  # kv_b_proj
        out = heads * arch.v_head_dim * h
        return ShardedCount(tp_split=q_up + kv_up + out, replicated=q_down + kv_down + h)
    q_dim = heads * arch.head_dim
    kv_dim = arch.num_query_groups * arch.head_dim
    weights = h * q_dim + 2 * h * kv_dim + q_dim * h
    bias = q_dim + 2 * kv_dim if arch.attention_bias else 0
    qk_norm = 2 * arch.head_dim if arch.qk_layernorm else 0
    return ShardedCount(tp_split=weights + bias, replicated=qk_norm + h)


def expert_params(arch: Arch) -> int:
    """One routed (or shared) expert: gate, up and down projections of a SwiGLU MLP."""
    return 3 * arch.hidden_size * arch.moe_ffn_hidden_size


def mlp_params(arch: Arch, layer: int) -> ShardedCount:
    """One layer's MLP block (dense SwiGLU or MoE), including its pre-MLP RMSNorm."""
    h = arch.hidden_size
    if not arch.is_moe_layer(layer):
        return ShardedCount(tp_split=3 * h * arch.ffn_hidden_size, replicated=h)
    router = h * arch.num_experts + (arch.num_experts if arch.router_expert_bias else 0)
    shared = arch.num_shared_experts * expert_params(arch)
    return ShardedCount(tp_split=shared, replicated=router + h, experts=arch.num_experts * expert_params(arch))


def layer_params(arch: Arch, layer: int) -> ShardedCount:
    """Decoder layer ``layer`` (0-based): attention + MLP/MoE + their norms."""
    return attention_params(arch) + mlp_params(arch, layer)


def embedding_params(arch: Arch) -> int:
    return arch.vocab_size * arch.hidden_size


def head_params(arch: Arch) -> int:
    """The output projection (0 when tied to the embedding)."""
    return 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size


def mtp_module_params(arch: Arch) -> int:
    """One multi-token-prediction module without the embedding and head it shares with the model:
    a MoE decoder layer, the eh_proj [h, 2h], and the enorm/hnorm/final norms."""
    h = arch.hidden_size
    return layer_params(arch, arch.num_layers).total + 2 * h * h + 3 * h


@dataclass(frozen=True)
class ParamCounts:
    """Whole-model counts, in parameters.

    ``total`` is the main model (embedding, all decoder layers, final norm, head) and excludes the
    multi-token-prediction modules, which are ``mtp`` (without the shared embedding and head).
    ``active`` is what one token uses: ``total`` minus the routed experts it is not sent to; it
    includes the embedding table and the head (subtract ``embedding``/``head`` for the other
    conventions vendors publish).
    """

    total: int
    active: int
    embedding: int
    head: int
    routed_experts: int
    mtp: int


def count_params(arch: Arch) -> ParamCounts:
    layers = sum(layer_params(arch, i).total for i in range(arch.num_layers))
    total = embedding_params(arch) + layers + arch.hidden_size + head_params(arch)
    routed = arch.num_moe_layers * arch.num_experts * expert_params(arch)
    idle = arch.num_moe_layers * (arch.num_experts - arch.moe_topk) * expert_params(arch)
    return ParamCounts(
        total=total, active=total - idle, embedding=embedding_params(arch), head=head_params(arch),
        routed_experts=routed, mtp=arch.num_mtp_layers * mtp_module_params(arch),
    )
