"""Which transformer layers the trainer builds, and the megatron settings that go with them, as a
function of the :class:`~megarl.platform.description.Platform`.

- ``transformer_engine``: transformer-engine's layers (CUDA only). megatron-bridge turns
  ``gradient_accumulation_fusion`` on whenever TE imports (``megatron/bridge/utils/fusions.py``,
  ``can_enable_gradient_accumulation_fusion``), but the model's output layer is megatron's own
  ``ColumnParallelLinear``, which raises without APEX's ``fused_weight_gradient_mlp_cuda``
  (``megatron/core/tensor_parallel/layers.py``, ``ColumnParallelLinear.__init__``): the fusion is on
  only where that extension imports.
- ``local``: megatron's pure-torch layers, on CPU or CUDA, with every fused kernel off (they live in
  TE, APEX or megatron's compiled extensions) and packed (THD) attention from
  :mod:`megarl.models.packed_attention`.
- ``auto``: transformer-engine on CUDA, local on CPU; on CUDA without an importable TE it is an
  error naming the import failure, never a silent fall-back to the slow layers.
"""
from __future__ import annotations

from megarl.platform.description import Platform

TE_MODULE = "transformer_engine.pytorch"
APEX_WGRAD_MODULE = "fused_weight_gradient_mlp_cuda"

# megatron TransformerConfig fields that need TE, APEX or megatron's compiled kernels, off for local layers.
LOCAL_UNFUSED = dict(
    gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
    masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, moe_grouped_gemm=False,
    moe_permute_fusion=False, moe_router_fusion=False, cross_entropy_loss_fusion=False,
)


def choose_layers(impl: str, platform: Platform) -> str:
    """``transformer_engine`` or ``local`` for ``model.transformer_impl=impl`` on ``platform``;
    ValueError (naming the key) where the choice cannot run."""
    if impl not in ("auto", "local", "transformer_engine"):
        raise ValueError(f"model.transformer_impl={impl!r}: one of auto, local, transformer_engine")
    if impl == "local" or (impl == "auto" and not platform.is_cuda):
        return "local"
    if not platform.is_cuda:
        raise ValueError("model.transformer_impl=transformer_engine: transformer-engine layers run on CUDA, and "
                         "this machine has no usable GPU; use local")
    if not platform.has(TE_MODULE):
        raise ValueError(f"model.transformer_impl={impl}: CUDA is available but {TE_MODULE} does not import "
                         f"({platform.why_missing(TE_MODULE)}); install the GPU extras (README, GPU install) "
                         "or set model.transformer_impl=local for megatron's unfused torch layers")
    return "transformer_engine"


def layer_settings(layers: str, platform: Platform) -> dict:
    """megatron TransformerConfig fields for ``layers`` (from :func:`choose_layers`) on ``platform``."""
    if layers == "transformer_engine":
        return dict(transformer_impl="transformer_engine",
                    gradient_accumulation_fusion=platform.has(APEX_WGRAD_MODULE))
    if layers == "local":
        return dict(transformer_impl="local", use_cpu_initialization=not platform.is_cuda, **LOCAL_UNFUSED)
    raise ValueError(f"unknown layers {layers!r}")
