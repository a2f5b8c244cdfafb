"""The RL training loss as ``AlgorithmConfig`` selects it.

``loss = agg(w * L_pg) + kl_coef * agg(KL) - entropy_coef * agg(H)``, with ``L_pg`` the per-token
policy loss, ``w`` the off-policy importance weight, KL the per-token estimator to the reference
model, H the per-token entropy (the entropy bonus), all reduced by the same aggregation ``agg``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from megarl.algos.aggregation import aggregation_fn
from megarl.algos.kl import kl_penalty
from megarl.algos.off_policy import is_weights, off_policy_sequence_mask
from megarl.algos.policy_loss import policy_loss_fn


@dataclass
class LossInputs:
    """One batch of per-token tensors, all [B, T] except ``advantages`` ([B] or [B, T])."""

    logprobs: torch.Tensor  # current policy, carries the gradient
    old_logprobs: torch.Tensor  # trainer's recomputed log-probs of the generating policy
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # float, 1 = trained token
    entropy: Optional[torch.Tensor] = None  # needed when entropy_coef != 0
    ref_logprobs: Optional[torch.Tensor] = None  # needed when kl_coef != 0
    rollout_logprobs: Optional[torch.Tensor] = None  # needed when off_policy_correction != none


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, torch.Tensor]  # detached scalars: pg_loss, clip_fraction, kl, entropy, is_weight_mean


def rl_loss(batch: LossInputs, cfg, denominator: Optional[float] = None) -> LossOutput:
    """The configured loss of one (micro-)batch; ``cfg`` is the ``algorithm`` section of the config
    (``megarl.config.schema.AlgorithmConfig``), ``denominator`` as in :mod:`megarl.algos.aggregation`."""
    agg = aggregation_fn(cfg.loss_agg)
    dropped = None
    if cfg.off_policy_mask_kl is not None:
        if batch.rollout_logprobs is None or batch.advantages.dim() != 1:
            raise ValueError("off_policy_mask_kl needs rollout_logprobs and per-sequence advantages [B]")
        keep = off_policy_sequence_mask(batch.old_logprobs, batch.rollout_logprobs, batch.advantages,
                                        batch.loss_mask, cfg.off_policy_mask_kl)
        dropped = (1.0 - keep).sum()
        batch = replace(batch, loss_mask=batch.loss_mask * keep[:, None])
    pg = policy_loss_fn(cfg.policy_loss)(
        batch.logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
    )
    weights = is_weights(
        cfg.off_policy_correction, cfg.off_policy_level, batch.old_logprobs, batch.rollout_logprobs,
        batch.loss_mask, cfg.is_threshold,
    )
    pg_loss = agg(weights * pg.per_token, batch.loss_mask, denominator)
    loss = pg_loss
    metrics = {
        "pg_loss": pg_loss.detach(),
        "clip_fraction": aggregation_fn("token_mean")(pg.clipped.to(weights.dtype), batch.loss_mask),
        "is_weight_mean": aggregation_fn("token_mean")(weights, batch.loss_mask),
    }
    if cfg.kl_coef != 0.0 and not cfg.kl_in_reward:  # in the reward, it is in the advantages already
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs ref_logprobs")
        kl = agg(kl_penalty(cfg.kl_type, batch.logprobs, batch.ref_logprobs, batch.old_logprobs), batch.loss_mask,
                 denominator)
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = kl.detach()
    if cfg.entropy_coef != 0.0:
        if batch.entropy is None:
            raise ValueError("entropy_coef != 0 needs entropy")
        entropy = agg(batch.entropy, batch.loss_mask, denominator)
        loss = loss - cfg.entropy_coef * entropy
        metrics["entropy"] = entropy.detach()
    if dropped is not None:
        metrics["off_policy_masked_sequences"] = dropped
    return LossOutput(loss, metrics)
