"""Per-token policy-gradient losses: PPO clip (with dual clip), GSPO, CISPO.

Shared contract: ``logprobs`` [B, T] (current policy, carries the gradient), ``old_logprobs`` [B, T]
(the policy the ratio is taken against, no gradient), ``advantages`` [B] (one per sequence) or
[B, T], float ``loss_mask`` [B, T] (1 = trained token). The result's ``per_token`` loss is [B, T]
and 0 where ``loss_mask`` is 0; reduce it with :mod:`megarl.algos.aggregation`. ``clipped`` [B, T]
marks the tokens whose ratio was clipped (for the clip-fraction metric).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megarl.algos.registry import choose


@dataclass
class PolicyLoss:
    per_token: torch.Tensor  # float [B, T], 0 where loss_mask == 0
    clipped: torch.Tensor  # bool [B, T]


PolicyLossFn = Callable[..., PolicyLoss]


def _prepare(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
    clip_low: float, clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked inputs: (masked log-ratio log(pi/pi_old), advantages as [B, T], bool mask)."""
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs, old_logprobs and loss_mask must all be [B, T]; got {tuple(logprobs.shape)}, "
            f"{tuple(old_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    if advantages.shape == logprobs.shape[:1]:
        advantages = advantages[:, None].expand_as(logprobs)
    elif advantages.shape != logprobs.shape:
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    keep = loss_mask > 0
    log_ratio = torch.where(keep, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    return log_ratio, advantages, keep


def _no_dual_clip(name: str, dual_clip: Optional[float]) -> None:
    if dual_clip is not None:
        raise ValueError(f"dual_clip applies to the ppo policy loss only, not {name}")


def ppo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: Optional[float] = None,
) -> PolicyLoss:
    """PPO clip with asymmetric range and optional dual clip.

    ``r = exp(logp - logp_old)``; ``L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``;
    with dual clip ``c > 1``, for ``A < 0``: ``L = min(L, -c A)`` (bounds the loss of a negative-advantage
    token whose ratio is far above 1). In a clipped region L is constant in ``logp``: zero gradient.
    """
    log_ratio, adv, keep = _prepare(logprobs, old_logprobs, advantages, loss_mask, clip_low, clip_high)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -adv * dual_clip
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        clipped = clipped | dual
    return PolicyLoss(torch.where(keep, loss, torch.zeros_like(loss)), clipped & keep)


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: Optional[float] = None,
) -> PolicyLoss:
    """GSPO: PPO clip on the length-normalised sequence ratio (default range: the GSPO paper's).

    ``s_i = exp(sum_t m_t (logp_t - logp_old_t) / sum_t m_t)``; per token
    ``L_t = max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high))`` with the GSPO-token ratio
    ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))``: its value is ``s_i`` and its gradient ``s_i grad logp_t``,
    so every token of a sequence gets the same gradient ``-A s_i`` (times the aggregation weight),
    which is exactly GSPO's sequence-level gradient for a per-sequence advantage.
    """
    _no_dual_clip("gspo", dual_clip)
    log_ratio, adv, keep = _prepare(logprobs, old_logprobs, advantages, loss_mask, clip_low, clip_high)
    lengths = keep.sum(dim=1).clamp(min=1)
    seq_log_ratio = log_ratio.sum(dim=1) / lengths
    token_ratio = (seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()).exp()
    unclipped = -adv * token_ratio
    clipped_loss = -adv * token_ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = (clipped_loss > unclipped) & keep
    return PolicyLoss(torch.where(keep, loss, torch.zeros_like(loss)), clipped)


def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: Optional[float] = None,
) -> PolicyLoss:
    """CISPO: REINFORCE weighted by the clipped, detached importance ratio.

    ``L_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t logp_t``. The ratio carries no gradient,
    so every token (clipped or not) gets gradient ``-clip(r_t) A_t`` w.r.t. ``logp_t``.
    """
    _no_dual_clip("cispo", dual_clip)
    log_ratio, adv, keep = _prepare(logprobs, old_logprobs, advantages, loss_mask, clip_low, clip_high)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * adv * logprobs
    clipped = (weight != ratio) & keep
    return PolicyLoss(torch.where(keep, loss, torch.zeros_like(loss)), clipped)


POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo": ppo, "gspo": gspo, "cispo": cispo}


def policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss ``AlgorithmConfig.policy_loss`` names."""
    return choose(POLICY_LOSSES, name, "policy_loss")
