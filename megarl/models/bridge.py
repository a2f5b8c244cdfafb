"""HF checkpoint -> megatron-bridge ``AutoBridge`` -> Megatron GPTModel under any TP/PP/EP/DP layout.

The bridge's own mappings convert weights both ways; megarl only picks the layer implementation
(:mod:`megarl.models.layers`: transformer-engine on GPU, megatron's local torch layers on CPU) and the
precision.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megarl.models import packed_attention
from megarl.models.layers import choose_layers, layer_settings
from megarl.models.lora import LoraConfig, apply_lora
from megarl.models.replayed_balancing import count_replayed_routes
from megarl.parallel import Layout
from megarl.platform.description import detect

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSettings:
    """How a trainer rank builds its model (besides the layout, the precision and the optimizer)
    (:func:`megarl.config.components.model_settings`)."""

    transformer_impl: str = "auto"  # auto | local | transformer_engine
    dispatcher: str = "alltoall"  # alltoall | allgather
    routing_replay: bool = False  # Keep Routing: the model replays the engine's experts
    recompute: str = "none"  # none | selective | full
    recompute_num_layers: int | None = None
    moe_aux_loss_coeff: float = 0.0
    reference: bool = False  # keep the starting weights as the KL reference (algorithm.kl_coef != 0)
    lora: LoraConfig | None = None  # train LoRA adapters on a frozen base (cfg.lora)
    moe_expert_bias_update_rate: float | None = None  # None: the checkpoint family's


@dataclass
class MegatronModel:
    """The bridge (for conversion back to HF) and this rank's model chunks (one per virtual stage)."""

    bridge: Any  # megatron.bridge.AutoBridge
    provider: Any  # megatron.bridge GPTModelProvider
    chunks: list  # list[MegatronModule], DDP-wrapped when built for training
    export_tasks: list | None = field(default=None, repr=False)  # this stage's conversion tasks, built once
    has_adapters: bool = False  # LoRA adapters on the chunks: an HF export merges them into the base weights


def load_bridge(hf_path: str | Path, dtype: str = "float32"):
    """``AutoBridge`` over an HF checkpoint directory, with a clear error for a bad checkpoint. Only the
    bridge of the checkpoint's architecture is imported (:mod:`megarl.models.bridge_registry`)."""
    from megarl.gc_pause import gc_paused
    from megarl.models.bridge_registry import auto_bridge_for
    from megarl.platform import megatron_cpu

    path = Path(hf_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_path={hf_path}: not an HF checkpoint (no config.json)")
    try:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    except json.JSONDecodeError as exc:
        raise ValueError(f"model.hf_path={hf_path}: config.json is not JSON: {exc}") from exc
    with gc_paused():
        megatron_cpu.apply()
        AutoBridge = auto_bridge_for(architectures)
    try:
        return AutoBridge.from_hf_pretrained(str(path), torch_dtype=DTYPES[dtype])
    except ValueError as exc:
        raise ValueError(f"model.hf_path={hf_path}: megatron-bridge cannot convert it: {exc}") from exc


def build_megatron_model(hf_path: str | Path, layout: Layout, model: ModelSettings = ModelSettings(), *,
                         dtype: str = "float32", ddp_config=None, load_weights: bool = True,
                         value_head: bool = False) -> MegatronModel:
    """Build this rank's Megatron chunks for ``layout`` and load the HF weights into them.

    ``model.recompute``: megatron's activation recompute, ``none`` | ``selective`` (see
    :func:`recompute_settings`) | ``full`` (every ``model.recompute_num_layers`` layers, default 1, keep
    only their input); ``model.reference`` is the caller's to keep.

    Call after :func:`megarl.trainer.distributed.init_rank`. With ``ddp_config`` the chunks are
    wrapped in megatron's DistributedDataParallel (for training); without, they are bare modules.
    ``load_weights=False`` builds the architecture only (for weights loaded from a Megatron checkpoint).
    ``model.lora``: freeze the base and add LoRA adapters (:func:`megarl.models.lora.apply_lora`) after
    the weights are loaded and before the DDP wrap, so DDP and the optimizer see the adapters only.
    ``value_head``: the critic's model, a scalar head in place of the output layer
    (:func:`megarl.models.value_head.attach_value_head`), added at the same point.
    ``model.moe_expert_bias_update_rate``: the routers' expert-bias update rate (None: the checkpoint family's;
    ValueError for a checkpoint whose routers have no expert bias). With ``model.routing_replay`` the auxiliary
    losses count the replayed routes (:mod:`megarl.models.replayed_balancing`).
    """
    from megatron.bridge.models.gpt_provider import local_layer_spec

    platform = detect()
    layers = choose_layers(model.transformer_impl, platform)
    te = layers == "transformer_engine"
    bridge = load_bridge(hf_path, dtype)
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    settings = parallel_settings(layout, dtype, model.dispatcher, model.routing_replay, model.moe_aux_loss_coeff)
    settings.update(recompute_settings(model.recompute, model.recompute_num_layers,
                                       grouped_experts=te and bool(getattr(provider, "moe_grouped_gemm", False))))
    settings.update(layer_settings(layers, platform))
    if not te:
        provider.transformer_layer_spec = local_layer_spec
        packed_attention.enable()
    if model.moe_expert_bias_update_rate is not None:
        if not getattr(provider, "moe_router_enable_expert_bias", False):
            raise ValueError(f"model.moe_expert_bias_update_rate: the routers of {hf_path} have no expert bias (it is "
                             "for sigmoid routers with e_score_correction_bias: deepseek_v3, glm4_moe)")
        settings["moe_router_bias_update_rate"] = model.moe_expert_bias_update_rate
    if model.routing_replay:
        count_replayed_routes()
    for key, value in settings.items():
        setattr(provider, key, value)
    provider.finalize()
    if model.lora is not None:
        provider.register_pre_wrap_hook(lambda chunks: apply_lora(chunks, model.lora))  # after the bridge's weight load
    if value_head:
        from megarl.models.value_head import attach_value_head

        provider.register_pre_wrap_hook(attach_value_head)
    half = dtype != "float32"
    chunks = provider.provide_distributed_model(
        ddp_config=ddp_config, wrap_with_ddp=ddp_config is not None,
        use_cpu_initialization=not platform.is_cuda,
        mixed_precision_wrapper=None if not half else _float16_wrapper(), bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
    )
    log.info("megatron model on this rank: %d parameters", sum(p.numel() for c in chunks for p in c.parameters()))
    return MegatronModel(bridge=bridge, provider=provider, chunks=chunks, has_adapters=model.lora is not None)


def parallel_settings(layout: Layout, dtype: str, dispatcher: str, routing_replay: bool,
                      moe_aux_loss_coeff: float) -> dict:
    """megatron TransformerConfig fields of the parallel layout, the dtype, the MoE dispatch and
    routing replay, with dropout off and the loss summed per token.

    Two pipeline stages with virtual stages exchange activations and gradients one op at a time
    (``batch_p2p_comm`` off): there the previous and the next stage are one peer, and megatron's batched
    exchange posts its sends to it as [gradient, activation] and its receives from it as [activation,
    gradient] on both ranks; point-to-point ops between two ranks pair in the order they are posted (NCCL
    and gloo alike), so each stage would take the other's gradient for an activation, silently. The
    unbatched ops order sends and receives by rank parity and put the two directions on two groups."""
    return dict(
        batch_p2p_comm=not (layout.pp == 2 and layout.vpp is not None),
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sequence_parallel, moe_token_dispatcher_type=dispatcher,
        moe_enable_routing_replay=routing_replay, moe_aux_loss_coeff=moe_aux_loss_coeff,
        params_dtype=DTYPES[dtype], pipeline_dtype=DTYPES[dtype], bf16=dtype == "bfloat16", fp16=dtype == "float16",
        hidden_dropout=0.0, attention_dropout=0.0,
        calculate_per_token_loss=True,  # token-mean over the global batch; see megarl/trainer/sft_step.py
    )


def recompute_settings(recompute: str, num_layers: int | None = None, grouped_experts: bool = False) -> dict:
    """megatron TransformerConfig fields of a ``trainer.recompute`` setting. ``selective``:
    megatron's ``core_attn``, plus ``moe_act`` (routed experts' activation) where the experts run
    as grouped GEMMs (transformer-engine), the only place megatron supports it."""
    if recompute == "none":
        return dict(recompute_granularity=None)
    if recompute == "selective":
        return dict(recompute_granularity="selective",
                    recompute_modules=["core_attn", "moe_act"] if grouped_experts else ["core_attn"])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=num_layers or 1)
    raise ValueError(f"trainer.recompute={recompute!r}: one of none, selective, full")


def _float16_wrapper():
    from megatron.core.transformer.module import Float16Module

    return Float16Module


def export_hf_state(model: MegatronModel) -> dict[str, torch.Tensor]:
    """Full HF-named tensors gathered from every TP/PP/EP shard (every rank receives all)."""
    return {name: tensor.detach().cpu().clone()
            for name, tensor in model.bridge.export_hf_weights(model.chunks, cpu=True, show_progress=False)}


def export_adapter_state(model: MegatronModel) -> dict[str, torch.Tensor]:
    """The LoRA adapters in HF PEFT names (``...q_proj.lora_A.weight``), gathered from every shard
    (collective; every rank receives all)."""
    return {w.param_name: w.weight.detach().cpu().clone()
            for w in model.bridge.export_adapter_weights(model.chunks, cpu=True, show_progress=False)}


def save_hf_adapter(model: MegatronModel, lora: LoraConfig, out_dir: str | Path) -> Path:
    """Write the LoRA adapters as an HF PEFT directory (``adapter_config.json`` +
    ``adapter_model.safetensors``), what ``peft.PeftModel.from_pretrained`` and SGLang's
    ``/load_lora_adapter`` read. Collective; rank 0 writes."""
    out = Path(out_dir)
    model.bridge.save_hf_adapter(model.chunks, str(out), peft_config=lora.peft(), show_progress=False)
    return out


def save_hf_checkpoint(model: MegatronModel, out_dir: str | Path) -> Path:
    """Write the model as an HF checkpoint directory (config, safetensors, tokenizer files)."""
    out = Path(out_dir)
    model.bridge.save_hf_pretrained(model.chunks, str(out))
    return out
