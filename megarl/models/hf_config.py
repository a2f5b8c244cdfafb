"""The one reader of an HF checkpoint's ``config.json``: the architecture numbers megarl needs.

A plain JSON read (``transformers.AutoConfig`` takes seconds to import and refuses model types the
installed version does not know, and fills in its own defaults; megarl needs to know what the file
says). Multimodal checkpoints keep the language model's numbers in ``text_config``, which wins
over the top level. The families name some numbers differently (Qwen3-MoE ``num_experts``, Mixtral
``num_local_experts``, DeepSeek-V3 / GLM-4.5 ``n_routed_experts``, ...): :data:`HF_KEYS` lists the
names per field, the first one present wins. A field is None when the file has none of its names.
A ``quantization_config`` (FP8 / block-quantized weights with their scales: DeepSeek-V3's official
checkpoint, the Qwen3 ``-FP8`` ones) is ``quantization``: megarl has no path for such weights
(:func:`quantized_refusal`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# HfConfig field -> the config.json keys that hold it, in order (the first present wins).
HF_KEYS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "num_layers", "n_layer"),
    "hidden_size": ("hidden_size", "d_model", "n_embd"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_query_groups": ("num_key_value_heads", "multi_query_group_num"),
    "head_dim": ("head_dim",),
    "ffn_hidden_size": ("intermediate_size",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "moe_topk": ("num_experts_per_tok", "moe_topk"),
    "num_shared_experts": ("n_shared_experts",),
    "first_k_dense_layers": ("first_k_dense_replace",),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    "num_mtp_layers": ("num_nextn_predict_layers",),
    "qk_layernorm": ("use_qk_norm",),
    "attention_bias": ("attention_bias",),
    "context_length": ("max_position_embeddings", "n_positions", "seq_length"),
    "mlp_only_layers": ("mlp_only_layers",),
    "decoder_sparse_step": ("decoder_sparse_step",),
}


@dataclass(frozen=True)
class HfConfig:
    """The numbers of one checkpoint's config.json (field names as in ``model.arch``; None: absent).

    ``head_dim`` is only what the file says (models differ in what they assume without it).
    Mixtral names its expert FFN size ``intermediate_size`` (every layer is MoE): with experts
    counted under ``num_local_experts`` and no ``moe_intermediate_size``, that size is
    ``moe_ffn_hidden_size`` too.
    """

    path: str  # the config.json read
    model_type: Optional[str]
    architectures: tuple[str, ...]
    num_layers: Optional[int]
    hidden_size: Optional[int]
    num_attention_heads: Optional[int]
    num_query_groups: Optional[int]  # KV heads
    head_dim: Optional[int]
    ffn_hidden_size: Optional[int]  # dense MLP
    moe_ffn_hidden_size: Optional[int]  # one routed expert
    num_experts: Optional[int]
    moe_topk: Optional[int]
    num_shared_experts: Optional[int]
    first_k_dense_layers: Optional[int]
    vocab_size: Optional[int]
    tie_word_embeddings: Optional[bool]
    q_lora_rank: Optional[int]
    kv_lora_rank: Optional[int]
    qk_nope_head_dim: Optional[int]
    qk_rope_head_dim: Optional[int]
    v_head_dim: Optional[int]
    num_mtp_layers: Optional[int]
    qk_layernorm: Optional[bool]
    attention_bias: Optional[bool]
    context_length: Optional[int]  # max_position_embeddings: the most prompt + response tokens
    mlp_only_layers: Optional[tuple[int, ...]]  # Qwen-MoE: dense layers among MoE ones
    decoder_sparse_step: Optional[int]  # Qwen-MoE: every n-th layer is MoE
    # the quantization_config's quant_method ("fp8", ...; "unknown" when it names none); None: not quantized
    quantization: Optional[str] = None

    def missing(self, *names: str) -> list[str]:
        """The config.json keys (``a/b`` for alternatives) of the ``names`` fields that are None."""
        return ["/".join(HF_KEYS[n]) for n in names if getattr(self, n) is None]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str = "config.json") -> HfConfig:
        """The numbers of a parsed config.json (``text_config`` first, when present)."""
        text = raw.get("text_config")
        hf = {**raw, **text} if isinstance(text, dict) else raw
        values: dict[str, Any] = {}
        for name, keys in HF_KEYS.items():
            values[name] = next((hf[k] for k in keys if hf.get(k) is not None), None)
        if values["moe_ffn_hidden_size"] is None and hf.get("num_local_experts") is not None:
            values["moe_ffn_hidden_size"] = values["ffn_hidden_size"]  # Mixtral naming
        if values["mlp_only_layers"] is not None:
            values["mlp_only_layers"] = tuple(values["mlp_only_layers"])
        quantization = hf.get("quantization_config") or raw.get("quantization_config")
        if isinstance(quantization, dict):
            quantization = str(quantization.get("quant_method") or "unknown")
        elif quantization is not None:
            quantization = "unknown"
        return cls(path=path, model_type=hf.get("model_type"), architectures=tuple(raw.get("architectures") or ()),
                   quantization=quantization, **values)


class InvalidHfConfig(ValueError):
    """A checkpoint's config.json that is not a JSON object; the message names the file (and the line)."""


def read_hf_config(hf_path: str | Path) -> HfConfig:
    """The numbers of ``hf_path/config.json``; FileNotFoundError when there is none, :class:`InvalidHfConfig`
    when it is not a JSON object."""
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_path} has no config.json (not an HF checkpoint directory)")
    try:
        raw = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise InvalidHfConfig(f"{path} is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from exc
    except UnicodeDecodeError as exc:
        raise InvalidHfConfig(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if not isinstance(raw, dict):
        raise InvalidHfConfig(f"{path} holds a JSON {type(raw).__name__}, not an object of model settings")
    return HfConfig.from_dict(raw, str(path))


def hf_config_if_present(hf_path: str | Path | None) -> Optional[HfConfig]:
    """:func:`read_hf_config`, or None when ``hf_path`` is unset or holds no config.json."""
    if not hf_path or not (Path(hf_path) / "config.json").is_file():
        return None
    return read_hf_config(hf_path)


def quantized_refusal(hf_path: str | Path, role: str) -> Optional[str]:
    """Why the checkpoint at ``hf_path`` cannot serve as ``role`` (e.g. "the policy") when its config.json
    has a ``quantization_config``; None when it has none (or no config.json). megarl trains, serves and
    syncs every model in ``model.dtype``: a policy's weight sync would write bf16 tensors into the
    engine's FP8 parameters beside their stale scales, and megatron-bridge reads quantized tensors
    without their scales."""
    hf = hf_config_if_present(hf_path)
    if hf is None or hf.quantization is None:
        return None
    return (f"{hf_path}/config.json has a quantization_config ({hf.quantization} weights with scales), which megarl "
            f"cannot use as {role}: it trains, serves and syncs weights in model.dtype and has no path for quantized "
            f"ones (a weight sync would cast bf16 into FP8 parameters beside stale scales); use the bf16 release "
            f"or dequantize it first")


def checkpoint_arch(hf_path: str | None) -> dict:
    """The layer, head, expert and vocabulary numbers of an HF checkpoint's config.json ({} when the
    checkpoint is not present); ``num_experts`` 0 for a dense model (a config.json naming no experts)."""
    hf = hf_config_if_present(hf_path) if hf_path else None
    if hf is None:
        return {}
    return {"num_layers": hf.num_layers, "num_experts": hf.num_experts or 0,
            "num_attention_heads": hf.num_attention_heads, "num_query_groups": hf.num_query_groups,
            "vocab_size": hf.vocab_size}
