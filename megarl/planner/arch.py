"""The architecture numbers the planner works from: ``model.arch`` filled in from the checkpoint.

A recipe for a model too large to load here states every number in ``model.arch``; a recipe whose
checkpoint is present (the tiny demo) may leave them ``None`` and they are read from its
``config.json``. A number missing from both is an error naming the key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from omegaconf import DictConfig

from megarl.config.errors import ConfigError
from megarl.config.schema import ArchConfig

FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3")

# HF config.json key for each Arch field, per family (first key present wins).
_HF_KEYS = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "num_attention_heads": ("num_attention_heads",),
    "num_query_groups": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "ffn_hidden_size": ("intermediate_size",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "moe_topk": ("num_experts_per_tok",),
    "num_shared_experts": ("n_shared_experts",),
    "first_k_dense_layers": ("first_k_dense_replace",),
    "vocab_size": ("vocab_size",),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    "num_mtp_layers": ("num_nextn_predict_layers",),
    "qk_layernorm": ("use_qk_norm",),
    "attention_bias": ("attention_bias",),
}

# Family facts that config.json does not spell out.
_QK_LAYERNORM_DEFAULT = {"qwen3_moe": True, "glm4_moe": False, "deepseek_v3": False}
_ROUTER_EXPERT_BIAS = {"qwen3_moe": False, "glm4_moe": True, "deepseek_v3": True}
# A recipe value still at its schema default is overridden by the checkpoint's, when there is one.
_SCHEMA_DEFAULTS = ArchConfig()
_MODEL_TYPE_FAMILY = {"qwen3_moe": "qwen3_moe", "glm4_moe": "glm4_moe", "deepseek_v3": "deepseek_v3"}


@dataclass(frozen=True)
class Arch:
    """Resolved architecture of a MoE decoder (all sizes are element counts, not bytes).

    ``head_dim`` is the q/k/v head size of standard attention; with multi-head latent attention
    (``kv_lora_rank > 0``) the ``qk_*``/``v_head_dim`` sizes are used instead.
    """

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    moe_ffn_hidden_size: int
    num_experts: int
    moe_topk: int
    num_shared_experts: int
    first_k_dense_layers: int
    vocab_size: int
    tie_word_embeddings: bool
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_mtp_layers: int
    qk_layernorm: bool
    attention_bias: bool
    router_expert_bias: bool  # a per-expert score-correction bias (sigmoid routers)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3)."""
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_layers

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_layers


def checkpoint_config(hf_path: str) -> dict:
    """The checkpoint's config.json as a dict ({} when the checkpoint is not present)."""
    path = Path(hf_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _from_checkpoint(hf: dict, name: str):
    for key in _HF_KEYS.get(name, ()):
        if hf.get(key) is not None:
            return hf[key]
    return None


def resolve_arch(cfg: DictConfig) -> Arch:
    """``cfg.model.arch`` with every value left ``None`` (or at its schema default) taken from the
    checkpoint's config.json when there is one.

    Raises :class:`ConfigError` naming ``model.arch.<key>`` when a number is in neither.
    """
    hf = checkpoint_config(cfg.model.hf_path)
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"model.hf_path: {cfg.model.hf_path} interleaves dense and MoE layers "
                          "(mlp_only_layers / decoder_sparse_step); the planner knows only first_k_dense_layers")
    given = cfg.model.arch
    family = _MODEL_TYPE_FAMILY.get(hf.get("model_type"), given.family)
    if family not in FAMILIES:
        raise ConfigError(f"model.arch.family: {family!r} is not one of {', '.join(FAMILIES)}")
    values: dict = {"family": family, "router_expert_bias": _ROUTER_EXPERT_BIAS[family]}
    for f in fields(Arch):
        if f.name in values:
            continue
        value = given[f.name]
        if value is None or value == getattr(_SCHEMA_DEFAULTS, f.name):
            from_ckpt = _from_checkpoint(hf, f.name)
            value = from_ckpt if from_ckpt is not None else value
        values[f.name] = value
    if values["qk_layernorm"] is None:
        values["qk_layernorm"] = _QK_LAYERNORM_DEFAULT[family]
    if values["attention_bias"] is None:
        values["attention_bias"] = False
    if values["head_dim"] is None and values["hidden_size"] and values["num_attention_heads"]:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values["num_query_groups"] is None:
        values["num_query_groups"] = values["num_attention_heads"]
    if values["ffn_hidden_size"] is None and values["first_k_dense_layers"] == 0:
        values["ffn_hidden_size"] = 0  # no dense MLP layer: the size is never used
    missing = [k for k, v in values.items() if v is None]
    if missing:
        where = f"{cfg.model.hf_path}/config.json" if hf else f"no checkpoint at {cfg.model.hf_path}"
        raise ConfigError(f"model.arch.{missing[0]}: not set in the recipe and not found ({where})")
    arch = Arch(**values)
    _check(arch)
    return arch


def _check(arch: Arch) -> None:
    if arch.num_experts < 1 or not 1 <= arch.moe_topk <= arch.num_experts:
        raise ConfigError(
            f"model.arch.moe_topk: need 1 <= moe_topk <= num_experts, got {arch.moe_topk} of {arch.num_experts}"
        )
    if not 0 <= arch.first_k_dense_layers <= arch.num_layers:
        raise ConfigError(f"model.arch.first_k_dense_layers: {arch.first_k_dense_layers} is not in [0, num_layers]")
    if arch.mla and not (arch.qk_nope_head_dim and arch.qk_rope_head_dim and arch.v_head_dim):
        raise ConfigError("model.arch.qk_nope_head_dim: latent attention (kv_lora_rank > 0) needs qk_nope/qk_rope/v head dims")
