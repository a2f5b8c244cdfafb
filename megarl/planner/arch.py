"""The architecture numbers the planner works from: ``model.arch`` filled in from the checkpoint.

A recipe for a model too large to load here states every number in ``model.arch``; a recipe whose
checkpoint is present (the tiny demo) may leave them ``None`` and they are read from its
``config.json``. A number missing from both is an error naming the key.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from omegaconf import DictConfig

from megarl.config.errors import ConfigError
from megarl.config.schema import ArchConfig
from megarl.models.hf_config import hf_config_if_present

# Family facts that config.json does not spell out.
_QK_LAYERNORM_DEFAULT = {"qwen3_moe": True, "glm4_moe": False, "deepseek_v3": False, "qwen3": True}  # qwen3: dense
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


def resolve_arch(cfg: DictConfig) -> Arch:
    """``cfg.model.arch`` with every value left ``None`` (or at its schema default) taken from the
    checkpoint's config.json when there is one.

    Raises :class:`ConfigError` naming ``model.arch.<key>`` when a number is in neither.
    """
    hf = hf_config_if_present(cfg.model.hf_path)
    given = cfg.model.arch
    family = _MODEL_TYPE_FAMILY.get(hf.model_type if hf else None, given.family)
    where = f"{cfg.model.hf_path}/config.json" if hf else f"no checkpoint at {cfg.model.hf_path}"
    return _resolve(given, hf, family, "model.arch", "model.hf_path", where)


def served_arch(hf_path: str, key: str) -> Arch | None:
    """The architecture of the model an auxiliary engine serves (a teacher, a judge, a frozen agent
    role: the auxiliary pools of :class:`megarl.config.topology.RunTopology`), read from ``hf_path/config.json``; None
    when the checkpoint is not here. Unlike the policy it may be dense (no routed experts: every layer
    a dense MLP) and of any family. ``key`` (e.g. ``teacher.hf_path``) names the errors."""
    hf = hf_config_if_present(hf_path)
    if hf is None:
        return None
    given = ArchConfig()
    if not hf.num_experts:  # dense: the planner's MoE numbers describe it with no routed experts
        given = dataclasses.replace(given, num_experts=0, moe_topk=0, moe_ffn_hidden_size=0,
                                    first_k_dense_layers=hf.num_layers)
    family = _MODEL_TYPE_FAMILY.get(hf.model_type, hf.model_type or "unknown")
    return _resolve(given, hf, family, key, key, hf.path)


def _resolve(given, hf, family: str, key: str, path_key: str, where: str) -> Arch:
    """``given`` (``model.arch`` or its schema defaults) with each value that is ``None`` or at its
    schema default taken from ``hf`` (a checkpoint's numbers, or None); errors name ``<key>.<number>``,
    or ``path_key`` for a checkpoint the planner cannot describe; ``where`` says where numbers were sought."""
    if hf is not None and (hf.mlp_only_layers or (hf.decoder_sparse_step or 1) != 1):
        raise ConfigError(f"{path_key}: {hf.path} interleaves dense and MoE layers (mlp_only_layers / "
                          "decoder_sparse_step); the planner knows only first_k_dense_layers")
    values: dict = {"family": family, "router_expert_bias": _ROUTER_EXPERT_BIAS.get(family, False)}
    for f in fields(Arch):
        if f.name in values:
            continue
        value = getattr(given, f.name)
        if value is None or value == getattr(_SCHEMA_DEFAULTS, f.name):
            from_ckpt = getattr(hf, f.name) if hf else None
            value = from_ckpt if from_ckpt is not None else value
        values[f.name] = value
    if values["qk_layernorm"] is None:
        values["qk_layernorm"] = _QK_LAYERNORM_DEFAULT.get(family, False)
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
        raise ConfigError(f"{key}.{missing[0]}: not set in the recipe and not found ({where})")
    arch = Arch(**values)
    _check(arch, key)
    return arch


def _check(arch: Arch, key: str) -> None:
    dense = arch.num_experts == 0 and arch.first_k_dense_layers == arch.num_layers
    if not dense and (arch.num_experts < 1 or not 1 <= arch.moe_topk <= arch.num_experts):
        raise ConfigError(
            f"{key}.moe_topk: need 1 <= moe_topk <= num_experts, got {arch.moe_topk} of {arch.num_experts}"
        )
    if not 0 <= arch.first_k_dense_layers <= arch.num_layers:
        raise ConfigError(f"{key}.first_k_dense_layers: {arch.first_k_dense_layers} is not in [0, num_layers]")
    if arch.mla and not (arch.qk_nope_head_dim and arch.qk_rope_head_dim and arch.v_head_dim):
        raise ConfigError(f"{key}.qk_nope_head_dim: latent attention (kv_lora_rank > 0) "
                          "needs qk_nope/qk_rope/v head dims")
