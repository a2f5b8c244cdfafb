"""Off-policy correction between the rollout engine (behaviour policy mu) and the trainer.

``old_logprobs`` [B, T] are the trainer's recomputed log-probs of the policy that generated the
batch, ``rollout_logprobs`` [B, T] the engine's; float ``loss_mask`` [B, T]. The token weight is
``w_t = exp(logp_old_t - logp_mu_t)``, the sequence weight ``w = prod_t w_t^(m_t)`` (computed in log
space). Weights carry no gradient and multiply the per-token policy loss.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence")


def _log_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                 level: str) -> torch.Tensor:
    """log w per token [B, T] (token level) or per sequence broadcast to [B, T] (sequence level)."""
    if old_logprobs.dim() != 2 or rollout_logprobs.shape != old_logprobs.shape or loss_mask.shape != old_logprobs.shape:
        raise ValueError(
            f"both log-prob tensors and loss_mask must all be [B, T]; got {tuple(old_logprobs.shape)}, "
            f"{tuple(rollout_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    if level not in LEVELS:
        raise ValueError(f"unknown off_policy_level {level!r}; valid: {', '.join(LEVELS)}")
    keep = loss_mask > 0
    log_w = torch.where(keep, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs)).detach()
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)
    return log_w


def truncated_is(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, threshold: float,
    level: str = "token"
) -> torch.Tensor:
    """TIS: ``min(w, C)`` with ``C = threshold`` (token or sequence weight), [B, T], 0 where m = 0."""
    if threshold < 1.0:
        raise ValueError(f"is_threshold must be >= 1, got {threshold}")
    log_w = _log_weights(old_logprobs, rollout_logprobs, loss_mask, level)
    return log_w.clamp(max=math.log(threshold)).exp() * (loss_mask > 0)


def masked_is(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, threshold: float,
    level: str = "token"
) -> torch.Tensor:
    """MIS: ``w * 1[1/C <= w <= C]`` with ``C = threshold``: tokens (or whole sequences) outside the band get 0."""
    if threshold < 1.0:
        raise ValueError(f"is_threshold must be >= 1, got {threshold}")
    log_w = _log_weights(old_logprobs, rollout_logprobs, loss_mask, level)
    inside = (log_w.abs() <= math.log(threshold)) & (loss_mask > 0)
    return torch.where(inside, log_w.exp(), torch.zeros_like(log_w))


def is_weights(
    kind: str,
    level: str,
    old_logprobs: torch.Tensor,
    rollout_logprobs: Optional[torch.Tensor],
    loss_mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """The correction ``AlgorithmConfig.off_policy_correction`` / ``off_policy_level`` name, [B, T].

    ``none`` gives ``1[m > 0]`` and needs no ``rollout_logprobs`` (may be None).
    """
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown off_policy_correction {kind!r}; valid: {', '.join(CORRECTIONS)}")
    if level not in LEVELS:
        raise ValueError(f"unknown off_policy_level {level!r}; valid: {', '.join(LEVELS)}")
    if kind == "none":
        return (loss_mask > 0).to(old_logprobs.dtype)
    if rollout_logprobs is None:
        raise ValueError(f"off_policy_correction={kind} needs rollout_logprobs")
    correction = truncated_is if kind == "tis" else masked_is
    return correction(old_logprobs, rollout_logprobs, loss_mask, threshold, level)


def off_policy_sequence_mask(
    logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
    max_kl: float
) -> torch.Tensor:
    """Drop sequences that are both negative and too far off-policy; float [B] (1 = keep).

    ``kl_i = sum_t m_t (logp_mu_t - logp_t) / sum_t m_t`` (the k1 estimate of KL(mu || pi) on mu's own
    samples); sequence i is dropped iff ``A_i < 0`` and ``kl_i > max_kl``. ``advantages`` is [B].
    """
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}")
    log_w = _log_weights(rollout_logprobs, logprobs, loss_mask, "token")
    kl = log_w.sum(dim=1) / (loss_mask > 0).sum(dim=1).clamp(min=1)
    return (~((advantages < 0) & (kl > max_kl))).to(logprobs.dtype)
