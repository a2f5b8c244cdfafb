"""The settings each component's builder takes, composed from the run config: the run config is read
here, above the components, and each builder gets its own typed value (never the run config).

``cfg`` is a loaded run config (:class:`megarl.config.schema.MegarlConfig`, or its structured
``DictConfig`` as :func:`megarl.config.load.default_config` gives it).
"""
from __future__ import annotations

from dataclasses import fields

from megarl.metrics.trackers import TrackerSettings
from megarl.models.bridge import ModelSettings
from megarl.trainer.critic import CriticSettings
from megarl.trainer.micro_batching import MicroBatching
from megarl.trainer.optimizer import OptimizerSettings
from megarl.trainer.settings import OptimizerConfig, WarmupConfig
from megarl.trainer.warmup import WarmupJob


def _optimizer(cfg, section, lr: float | None, updates_per_step: int) -> OptimizerSettings:
    keys = {f.name: getattr(section, f.name) for f in fields(OptimizerConfig)}
    return OptimizerSettings(**dict(keys, lr=keys["lr"] if lr is None else lr),
                             lr_decay_steps=max(cfg.steps * updates_per_step, 1), dtype=cfg.model.dtype)


def tracker_settings(cfg) -> TrackerSettings:
    """The run's trackers: ``logging.trackers`` and their sections, ``run_name`` and the whole config resolved
    (what the trackers record of the run)."""
    from omegaconf import OmegaConf

    return TrackerSettings(names=list(cfg.logging.trackers), wandb=cfg.logging.wandb, mlflow=cfg.logging.mlflow,
                           run_name=cfg.run_name,
                           config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True))


def optimizer_settings(cfg, lr: float | None = None, updates_per_step: int = 1) -> OptimizerSettings:
    """The policy's optimizer: ``trainer``'s optimizer keys, ``model.dtype``; ``lr`` overrides ``trainer.lr``
    (the warm-up has its own); the LR decays over ``steps * updates_per_step`` optimizer steps (RL:
    ``trainer.updates_per_step``)."""
    return _optimizer(cfg, cfg.trainer, lr, updates_per_step)


def critic_settings(cfg, start_checkpoint: str) -> CriticSettings | None:
    """The critic (None when ``critic.enabled`` is false): its checkpoint (``critic.hf_path``, else
    ``start_checkpoint``, the policy's) and its optimizer, whose LR decays over the policy's optimizer steps."""
    c = cfg.critic
    if not c.enabled:
        return None
    return CriticSettings(hf_path=c.hf_path or start_checkpoint,
                          optimizer=_optimizer(cfg, c, None, cfg.trainer.updates_per_step))


def model_settings(cfg) -> ModelSettings:
    """How a trainer rank builds the policy: ``model``, ``parallel.dispatcher``, ``trainer.recompute*``,
    Keep Routing (``rollout.keep_routing``), the reference (``algorithm.kl_coef != 0``), ``lora``."""
    t = cfg.trainer
    return ModelSettings(transformer_impl=str(cfg.model.transformer_impl.value),
                         dispatcher=str(cfg.parallel.dispatcher.value),
                         routing_replay=cfg.rollout.keep_routing, recompute=str(t.recompute.value),
                         recompute_num_layers=t.recompute_num_layers, moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
                         reference=cfg.algorithm.kl_coef != 0.0, lora=cfg.enabled_lora,
                         moe_expert_bias_update_rate=cfg.model.moe_expert_bias_update_rate)


def warmup_job(cfg) -> WarmupJob:
    """The supervised warm-up: ``warmup`` (steps, batch, lr, logging, output), the task's operands and seed,
    the trainer's micro-batch budget and optimizer (with ``warmup.lr``), the model."""
    w = cfg.warmup
    return WarmupJob(**{f.name: getattr(w, f.name) for f in fields(WarmupConfig)}, hf_path=cfg.model.hf_path,
                     run_dir=cfg.logging.run_dir, optimizer=optimizer_settings(cfg, w.lr),
                     max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch,
                     max_operand=cfg.task.max_operand, seed=cfg.task.seed,
                     transformer_impl=cfg.model.transformer_impl.value, dispatcher=cfg.parallel.dispatcher.value,
                     env=cfg.task.env, tool_calling=cfg.model.tiny_variant.value == "tool_calling")


def micro_batching(cfg, vocab_size: int, pad_id: int) -> MicroBatching:
    """How every trainer step of the run cuts and runs its batch: ``trainer.max_tokens_per_microbatch``,
    ``trainer.pack_sequences``, ``parallel.sequence_parallel``, ``rollout.keep_routing`` and ``rollout.temperature``,
    with the served model's ``vocab_size`` and the tokenizer's ``pad_id``."""
    return MicroBatching(max_tokens=cfg.trainer.max_tokens_per_microbatch,
                         sequence_parallel=cfg.parallel.sequence_parallel, pack=cfg.trainer.pack_sequences,
                         pad_id=pad_id, vocab_size=vocab_size, keep_routing=cfg.rollout.keep_routing,
                         temperature=cfg.rollout.temperature)
