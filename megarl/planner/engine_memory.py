"""Per-GPU memory of one SGLang engine: weights and KV cache (units: bytes, tokens).

An engine spans ``engine_tp`` GPUs. SGLang splits routed experts over ``engine_ep`` ranks and
each expert over ``engine_tp / engine_ep``, so every GPU holds ``1/engine_tp`` of the experts;
dense MLPs, shared experts, embedding and head are split over ``engine_tp``. Attention is split
over the attention-TP size, which is ``engine_tp`` without DP attention and 1 with it (megarl
runs DP attention with one attention replica per GPU, ``dp = engine_tp``); KV heads are
replicated when the attention-TP size exceeds their number. SGLang's static pool is
``mem_fraction_static * gpu_memory_gb`` and holds the weights and the KV cache.

With LoRA adapters synced as adapters (``lora.enabled``, ``lora.sync=adapter``; SGLang
``--enable-lora``) the pool also holds SGLang's LoRA buffers, allocated when the engine starts and
before the KV cache is sized: ``max_loras_per_batch`` slots (megarl's engines ask for
:data:`megarl.models.lora.ENGINE_ADAPTER_SLOTS`: the base, the adapter being replaced, the new one)
for every targeted module of every layer at the adapter's rank (:func:`engine_adapter_params`).
"""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.config.topology import EnginePoolSpec
from megarl.models.lora import ENGINE_ADAPTER_SLOTS, LoraConfig
from megarl.planner.arch import Arch
from megarl.planner.params import attention_params, embedding_params, head_params, mlp_params
from megarl.planner.units import GIB, dtype_bytes


@dataclass(frozen=True)
class EngineMemory:
    """One engine GPU: bytes of weights and KV cache; KV capacity in tokens."""

    gpus_per_engine: int
    attention_tp: int
    weights: int  # bytes per GPU
    pool: int  # SGLang static pool per GPU, bytes
    kv_cache: int  # bytes per GPU
    kv_bytes_per_token: int  # per GPU
    kv_tokens_per_replica: int  # tokens one attention replica holds (the whole engine without DP attention)
    kv_tokens_per_engine: int  # tokens the engine holds at once (all DP-attention replicas)
    max_sequence_tokens: int  # max_prompt_tokens + max_new_tokens
    lora_buffers: int = 0  # bytes per GPU of SGLang's LoRA pool (adapter sync only)
    lora_slots: int = 0  # adapters the pool holds at once (SGLang's max_loras_per_batch)


def kv_heads_per_rank(arch: Arch, attention_tp: int) -> int:
    """KV heads one attention-TP rank holds (replicated when attention_tp exceeds them)."""
    return max(1, arch.num_query_groups // attention_tp)


def kv_bytes_per_token(arch: Arch, attention_tp: int, size: int) -> int:
    """KV-cache bytes one token takes on one GPU: K and V of every layer, or MLA's latent + rope key."""
    if arch.mla:
        return arch.num_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * size
    return 2 * arch.num_layers * kv_heads_per_rank(arch, attention_tp) * arch.head_dim * size


def engine_weight_params(arch: Arch, tp: int, attention_tp: int) -> float:
    """Parameters on one engine GPU (see the module docstring for the split)."""
    attn = attention_params(arch)
    if arch.mla:
        attn_per_gpu = attn.tp_split / attention_tp + attn.replicated
    else:
        kv = 2 * arch.hidden_size * arch.num_query_groups * arch.head_dim
        kv_bias = 2 * arch.num_query_groups * arch.head_dim if arch.attention_bias else 0
        kv_per_gpu = (kv + kv_bias) * kv_heads_per_rank(arch, attention_tp) / arch.num_query_groups
        attn_per_gpu = (attn.tp_split - kv - kv_bias) / attention_tp + kv_per_gpu + attn.replicated
    mlp = sum((m.tp_split + m.experts) / tp + m.replicated
              for m in (mlp_params(arch, i) for i in range(arch.num_layers)))
    vocab = (embedding_params(arch) + head_params(arch)) / tp
    return arch.num_layers * attn_per_gpu + mlp + vocab + arch.hidden_size


def engine_memory(arch: Arch, cfg: DictConfig, engine: EnginePoolSpec | None = None) -> EngineMemory:
    """One GPU of a policy engine (``rollout.engine_tp`` / ``engine_ep`` / ``engine_dp_attention``, the
    LoRA buffers of an adapter sync, ``rollout.kv_cache_gb`` if set), or of the auxiliary ``engine``
    serving ``arch`` (its own ranks, no adapters, the KV cache what its weights leave). Either's pool is
    ``rollout.mem_fraction_static`` of ``trainer.gpu_memory_gb`` and must hold one sequence of
    ``rollout.max_prompt_tokens + max_new_tokens`` per attention replica (what a teacher scores; a
    judge's template and answer come on top). ``rollout.max_total_tokens`` caps every engine's KV cache at
    that many tokens a replica, as SGLang's ``--max-total-tokens`` does (the CPU recipes size theirs so)."""
    r = cfg.rollout
    size = dtype_bytes(cfg.model.dtype)
    tp, ep, dp_attention = (r.engine_tp, r.engine_ep, r.engine_dp_attention) if engine is None else \
        (engine.tp, engine.ep, engine.dp_attention)
    attention_tp = 1 if dp_attention else tp
    weights = round(size * engine_weight_params(arch, tp, attention_tp))
    pool = round(r.mem_fraction_static * cfg.trainer.gpu_memory_gb * GIB)
    lora = cfg.enabled_lora if engine is None else None
    slots = ENGINE_ADAPTER_SLOTS if lora is not None and lora.sync == "adapter" else 0
    lora_buffers = slots * size * engine_adapter_params(arch, lora, tp, ep, attention_tp) if slots else 0
    kv_cache = round(r.kv_cache_gb * GIB) if r.kv_cache_gb is not None and engine is None else \
        max(0, pool - weights - lora_buffers)
    per_token = kv_bytes_per_token(arch, attention_tp, size)
    tokens = kv_cache // per_token if r.max_total_tokens is None else min(kv_cache // per_token, r.max_total_tokens)
    replicas = tp if dp_attention else 1
    return EngineMemory(
        gpus_per_engine=tp, attention_tp=attention_tp, weights=weights, pool=pool,
        kv_cache=kv_cache if r.max_total_tokens is None else tokens * per_token, kv_bytes_per_token=per_token,
        kv_tokens_per_replica=tokens, kv_tokens_per_engine=tokens * replicas,
        max_sequence_tokens=r.max_prompt_tokens + r.max_new_tokens, lora_buffers=lora_buffers, lora_slots=slots,
    )


def engine_adapter_params(arch: Arch, lora: LoraConfig, engine_tp: int, engine_ep: int, attention_tp: int) -> int:
    """Parameters of one adapter slot of SGLang's LoRA pool on one engine GPU (see the module
    docstring): buffers for every layer's targeted modules, whichever layers the adapter names.
    Column-parallel modules (q/k/v, gate/up, MLA up-projections) keep ``A`` whole and split
    ``B``'s outputs; row-parallel ones (o, down) split ``A``'s inputs and keep ``B`` whole; the
    MLA down-projections are replicated; routed experts hold ``experts / engine_ep`` experts split
    over ``engine_tp / engine_ep``. SGLang serves no adapter on the router."""
    r, h = lora.rank, arch.hidden_size
    leaves = {t.rsplit(".", 1)[-1] for t in lora.target_modules}
    moe_tp = max(1, engine_tp // max(1, engine_ep))
    local_experts = arch.num_experts // max(1, engine_ep)

    def column(fan_in: int, outs: tuple[int, ...], tp: int) -> float:
        return r * (len(outs) * fan_in + sum(outs) / tp)

    def row(fan_in: int, fan_out: int, tp: int) -> float:
        return r * (fan_in / tp + fan_out)

    total = 0.0
    for layer in range(arch.num_layers):
        if arch.mla:
            qk_head = arch.qk_nope_head_dim + arch.qk_rope_head_dim
            heads = arch.num_attention_heads
            if "linear_q_down_proj" in leaves:
                total += column(h, (arch.q_lora_rank,), 1)
            if "linear_q_up_proj" in leaves:
                total += column(arch.q_lora_rank, (heads * qk_head,), attention_tp)
            if "linear_q_proj" in leaves:
                total += column(h, (heads * qk_head,), attention_tp)
            if "linear_kv_down_proj" in leaves:
                total += column(h, (arch.kv_lora_rank + arch.qk_rope_head_dim,), 1)
            if "linear_kv_up_proj" in leaves:
                total += column(arch.kv_lora_rank, (heads * (arch.qk_nope_head_dim + arch.v_head_dim),), attention_tp)
            if "linear_proj" in leaves:
                total += row(heads * arch.v_head_dim, h, attention_tp)
        else:
            d, q = arch.head_dim, arch.num_attention_heads * arch.head_dim
            if "linear_qkv" in leaves:  # K/V heads replicated when attention TP exceeds them
                total += r * (3 * h + q / attention_tp + 2 * kv_heads_per_rank(arch, attention_tp) * d)
            if "linear_proj" in leaves:
                total += row(q, h, attention_tp)
        if not arch.is_moe_layer(layer):
            f = arch.ffn_hidden_size
            total += column(h, (f, f), engine_tp) if "linear_fc1" in leaves else 0
            total += row(f, h, engine_tp) if "linear_fc2" in leaves else 0
            continue
        f, s = arch.moe_ffn_hidden_size, arch.num_shared_experts * arch.moe_ffn_hidden_size
        if "linear_fc1" in leaves:
            total += local_experts * column(h, (f, f), moe_tp) + (column(h, (s, s), engine_tp) if s else 0)
        if "linear_fc2" in leaves:
            total += local_experts * row(f, h, moe_tp) + (row(s, h, engine_tp) if s else 0)
    return round(total)
