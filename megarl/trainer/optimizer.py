"""Megatron's (distributed) Adam optimizer with gradient clipping and the LR warm-up/decay schedule."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.fields import setting
from megarl.trainer.settings import DTYPES, OptimizerConfig


@dataclass(frozen=True)
class OptimizerSettings(OptimizerConfig):
    """The optimizer and LR schedule of one run: the ``trainer`` section's optimizer keys (its schema node,
    :class:`megarl.trainer.settings.OptimizerConfig`) and what the run derives from the rest of the config
    (:func:`megarl.config.components.optimizer_settings`)."""

    lr_decay_steps: int = setting(1, ge=1)  # steps over which the LR decays
    dtype: str = setting("float32", choices=DTYPES)  # the model's parameter and compute dtype


def cpu_offload_options(offload: bool) -> dict:
    """megatron-core's OptimizerConfig fields that put the whole optimizer in host memory: its
    HybridDeviceOptimizer with every parameter on the host (``optimizer_offload_fraction=1``), reached
    through the precision-aware distributed optimizer's code path (which it reuses, as Megatron-LM's
    ``--optimizer-cpu-offload`` requires); host copies pinned when there is a GPU to copy from."""
    if not offload:
        return {}
    pinned = torch.cuda.is_available()
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0, "use_precision_aware_optimizer": True,
            "pin_cpu_grads": pinned, "pin_cpu_params": pinned}


def build_optimizer(chunks: list, settings: OptimizerSettings):
    """(optimizer, scheduler) over the DDP-wrapped ``chunks``; call ``scheduler.step(1)`` per step."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megarl.platform.megatron_cpu import cuda_tensor_type_scope

    config = OptimizerConfig(
        optimizer="adam", lr=settings.lr, min_lr=settings.min_lr, weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1, adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad, use_distributed_optimizer=settings.use_distributed_optimizer,
        bf16=settings.dtype == "bfloat16", fp16=settings.dtype == "float16",
        params_dtype={"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[settings.dtype],
        **cpu_offload_options(settings.optimizer_cpu_offload),
    )
    with cuda_tensor_type_scope():
        optimizer = get_megatron_optimizer(config, chunks)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if settings.lr_warmup_steps else settings.lr, max_lr=settings.lr,
        min_lr=settings.min_lr, lr_warmup_steps=settings.lr_warmup_steps,
        lr_decay_steps=max(settings.lr_decay_steps, settings.lr_warmup_steps + 1),
        lr_decay_style=settings.lr_decay_style, start_wd=settings.weight_decay, end_wd=settings.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant",
    )
    return optimizer, scheduler


def optimizer_step(optimizer, scheduler) -> tuple[bool, float]:
    """One optimizer step (gradient clipping included) and one LR-schedule step.

    Returns (whether the update was applied, the gradient norm before clipping).
    """
    from megarl.platform.megatron_cpu import cuda_tensor_type_scope

    with cuda_tensor_type_scope():
        applied, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    return bool(applied), float(grad_norm) if grad_norm is not None else float("nan")
