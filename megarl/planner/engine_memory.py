"""Per-GPU memory of one SGLang engine: weights and KV cache (units: bytes, tokens).

An engine spans ``engine_tp`` GPUs. SGLang splits routed experts over ``engine_ep`` ranks and
each expert over ``engine_tp / engine_ep``, so every GPU holds ``1/engine_tp`` of the experts;
dense MLPs, shared experts, embedding and head are split over ``engine_tp``. Attention is split
over the attention-TP size, which is ``engine_tp`` without DP attention and 1 with it (megarl
runs DP attention with one attention replica per GPU, ``dp = engine_tp``); KV heads are
replicated when the attention-TP size exceeds their number. SGLang's static pool is
``mem_fraction_static * gpu_memory_gb`` and holds the weights and the KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

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


def engine_memory(arch: Arch, cfg: DictConfig) -> EngineMemory:
    r = cfg.rollout
    size = dtype_bytes(cfg.model.dtype)
    attention_tp = 1 if r.engine_dp_attention else r.engine_tp
    weights = round(size * engine_weight_params(arch, r.engine_tp, attention_tp))
    pool = round(r.mem_fraction_static * cfg.trainer.gpu_memory_gb * GIB)
    kv_cache = round(r.kv_cache_gb * GIB) if r.kv_cache_gb is not None else max(0, pool - weights)
    per_token = kv_bytes_per_token(arch, attention_tp, size)
    replicas = r.engine_tp if r.engine_dp_attention else 1
    return EngineMemory(
        gpus_per_engine=r.engine_tp, attention_tp=attention_tp, weights=weights, pool=pool,
        kv_cache=kv_cache, kv_bytes_per_token=per_token,
        kv_tokens_per_replica=kv_cache // per_token, kv_tokens_per_engine=(kv_cache // per_token) * replicas,
        max_sequence_tokens=r.max_prompt_tokens + r.max_new_tokens,
    )
