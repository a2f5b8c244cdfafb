"""Off-policy (rollout) correction between the rollout engine (behaviour policy mu) and the trainer.

``old_logprobs`` [B, T] are the trainer's log-probs of the batch (:data:`OLD_POLICIES` says which),
``rollout_logprobs`` [B, T] the engine's; float ``loss_mask`` [B, T] (m, 1 = trained token).
The weight is ``w = exp(clamp(l, -20, 20))`` with the log-ratio ``l`` at one of three levels:
``token`` ``l_t = logp_old_t - logp_mu_t``, ``sequence`` ``l = sum_t m_t l_t`` (the product of the token
ratios), ``geometric`` ``l = sum_t m_t l_t / sum_t m_t`` (their geometric mean), broadcast to the
sequence's tokens. Weights carry no gradient and multiply the per-token policy loss.

The corrections and the names of the peers (verl ``verl/trainer/ppo/rollout_corr_helper.py``;
slime ``examples/train_infer_mismatch_helper/mis.py``, ``compute_mis_weights``, and
``slime/backends/megatron_utils/loss.py``; SkyRL ``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py``):

- ``tis``: truncate, ``clamp(w, low, C)`` with ``C = is_threshold`` and ``low = is_threshold_low``
  (default 0: verl's ``rollout_is`` truncation, SkyRL's ``tis_ratio_type`` and slime's ``truncate`` mode);
  with a lower bound it is slime's ``clip`` mode and its vanilla TIS ``clamp(w, tis_clip_low, tis_clip)``.
- ``mis``: mask (reject) tokens (or whole sequences, at the sequence levels) with ``w`` outside
  ``[low, C]`` (bounds inclusive; ``low`` default ``1 / C``, the peers' default); the kept ones keep
  their weight ``w`` (slime's ``mask`` mode; IcePop with independent low and high bounds).
- rejection criteria (any correction, ``off_policy_rejection``): verl's divergence criteria, chained
  (:mod:`megarl.algos.rejection`); with ``none`` it is rejection without reweighting (verl's
  ``rollout_is=null`` with ``rollout_rs``), with ``tis`` truncation at ``off_policy_level`` and rejection
  at the criteria's own level.
- veto (any correction): a sequence with a trained token whose raw ratio ``exp(l_t)`` is below
  ``off_policy_veto_threshold`` (slime ``rs_veto_threshold``, SkyRL ``outlier_token_is_threshold_low``)
  or above ``off_policy_veto_threshold_high`` (SkyRL ``outlier_token_is_threshold_high``) leaves the
  loss mask whole.

Rejected tokens leave the loss mask and with it every aggregation's denominator, as in verl (its
rejection rewrites ``response_mask``, from which the token counts are taken). Not every peer does so:
slime's current reducer keeps the pre-rejection per-rollout denominators (``rollout_mask_sums``), its
``icepop_function`` zeroes the weight only, and AReaL's ``ppo_actor_loss_fn`` divides by the original
token count on purpose.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megarl.algos.rejection import Criterion, rejection_keep

# The PPO ratio's old policy (``algorithm.old_policy``): ``recompute``, the trainer's log-probs before the
# step's first update (verl's and slime's default); ``rollout``, the engine's (verl's bypass mode: the PPO
# ratio to the rollout policy is the correction, and the criteria compare the current policy with it)
OLD_POLICIES = ("recompute", "rollout")
CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence", "geometric")
SAFETY_BOUND = 20.0  # |log w| is clamped to this before exp (verl and slime: exp(20) ~ 4.9e8)


def _check(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> None:
    if old_logprobs.dim() != 2 or rollout_logprobs.shape != old_logprobs.shape or loss_mask.shape != old_logprobs.shape:
        raise ValueError(
            f"both log-prob tensors and loss_mask must all be [B, T]; got {tuple(old_logprobs.shape)}, "
            f"{tuple(rollout_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )


def log_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                level: str) -> torch.Tensor:
    """Clamped ``log w`` [B, T] at ``level`` (module docstring), detached, 0 where m = 0."""
    _check(old_logprobs, rollout_logprobs, loss_mask)
    if level not in LEVELS:
        raise ValueError(f"unknown off_policy_level {level!r}; valid: {', '.join(LEVELS)}")
    trained = loss_mask > 0
    log_w = torch.where(trained, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs)).detach()
    if level != "token":
        total = log_w.sum(dim=1, keepdim=True)
        if level == "geometric":
            total = total / trained.sum(dim=1, keepdim=True).clamp(min=1)
        log_w = total.expand_as(log_w)
    return torch.where(trained, log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND), torch.zeros_like(log_w))


def _bounds(kind: str, threshold: float, threshold_low: Optional[float]) -> tuple[float, float]:
    if threshold < 1.0:
        raise ValueError(f"is_threshold must be >= 1, got {threshold}")
    low = threshold_low if threshold_low is not None else (0.0 if kind == "tis" else 1.0 / threshold)
    if not 0.0 <= low <= 1.0:
        raise ValueError(f"is_threshold_low must be in [0, 1], got {low}")
    return low, threshold


def truncated_is(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, threshold: float,
    level: str = "token", threshold_low: Optional[float] = None,
) -> torch.Tensor:
    """TIS: ``clamp(w, low, C)``, [B, T], 0 where m = 0; ``C = threshold``, ``low = threshold_low`` or 0."""
    low, high = _bounds("tis", threshold, threshold_low)
    w = log_weights(old_logprobs, rollout_logprobs, loss_mask, level).exp()
    return w.clamp(low, high) * (loss_mask > 0)


def masked_is(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, threshold: float,
    level: str = "token", threshold_low: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MIS: (weights ``w`` [B, T], 0 where m = 0; keep bool [B, T], the trained tokens with
    ``low <= w <= C``); ``C = threshold``, ``low = threshold_low`` or ``1 / C``."""
    low, high = _bounds("mis", threshold, threshold_low)
    w = log_weights(old_logprobs, rollout_logprobs, loss_mask, level).exp()
    trained = loss_mask > 0
    return w * trained, trained & (w >= low) & (w <= high)


def veto(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
         threshold: Optional[float], threshold_high: Optional[float] = None) -> torch.Tensor:
    """bool [B], False for a sequence with a trained token whose raw ratio ``exp(l_t)`` is below
    ``threshold`` or above ``threshold_high`` (None: no such bound; compared in log space, unclamped)."""
    _check(old_logprobs, rollout_logprobs, loss_mask)
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ValueError(f"off_policy_veto_threshold must be in (0, 1], got {threshold}")
    if threshold_high is not None and threshold_high < 1.0:
        raise ValueError(f"off_policy_veto_threshold_high must be >= 1, got {threshold_high}")
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    outside = torch.zeros_like(log_ratio, dtype=torch.bool)
    if threshold is not None:
        outside |= log_ratio < math.log(threshold)
    if threshold_high is not None:
        outside |= log_ratio > math.log(threshold_high)
    return ~(outside & (loss_mask > 0)).any(dim=1)


@dataclass
class Correction:
    weights: torch.Tensor  # float [B, T], no gradient, 0 where loss_mask == 0
    keep: torch.Tensor  # bool [B, T]: trained tokens that stay in the loss (False where rejected)


def _weights(kind: str, level: str, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
             loss_mask: torch.Tensor, threshold: float, threshold_low: Optional[float]) -> Correction:
    trained = loss_mask > 0
    if kind == "tis":
        return Correction(truncated_is(old_logprobs, rollout_logprobs, loss_mask, threshold, level, threshold_low),
                          trained)
    if kind == "mis":
        return Correction(*masked_is(old_logprobs, rollout_logprobs, loss_mask, threshold, level, threshold_low))
    return Correction(trained.to(old_logprobs.dtype), trained)


@dataclass(frozen=True)
class CorrectionSpec:
    """The correction ``AlgorithmConfig`` names: ``off_policy_correction`` (kind), ``off_policy_level``,
    ``is_threshold``, ``is_threshold_low``, ``off_policy_veto_threshold``, ``off_policy_veto_threshold_high``
    and the parsed ``off_policy_rejection`` criteria (:func:`megarl.algos.rejection.parse_criteria`)."""
    kind: str
    level: str
    threshold: float
    threshold_low: Optional[float] = None
    veto_threshold: Optional[float] = None
    veto_threshold_high: Optional[float] = None
    rejection: Sequence[Criterion] = ()


def correction(old_logprobs: torch.Tensor, rollout_logprobs: Optional[torch.Tensor], loss_mask: torch.Tensor,
               spec: CorrectionSpec) -> Correction:
    """The correction ``spec`` names, weights and keep mask [B, T].

    ``none`` without veto or criteria gives weights ``1[m > 0]`` and needs no ``rollout_logprobs`` (may be None).
    """
    kind, level = spec.kind, spec.level
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown off_policy_correction {kind!r}; valid: {', '.join(CORRECTIONS)}")
    if level not in LEVELS:
        raise ValueError(f"unknown off_policy_level {level!r}; valid: {', '.join(LEVELS)}")
    vetoed = spec.veto_threshold is not None or spec.veto_threshold_high is not None
    if kind == "none" and not vetoed and not spec.rejection:
        trained = loss_mask > 0
        return Correction(trained.to(old_logprobs.dtype), trained)
    if rollout_logprobs is None:
        what = f"off_policy_correction={kind}" if kind != "none" else (
            "off_policy_veto_threshold" if vetoed else "off_policy_rejection")
        raise ValueError(f"{what} needs rollout_logprobs")
    out = _weights(kind, level, old_logprobs, rollout_logprobs, loss_mask, spec.threshold, spec.threshold_low)
    keep = out.keep
    if vetoed:
        keep = keep & veto(old_logprobs, rollout_logprobs, loss_mask, spec.veto_threshold,
                           spec.veto_threshold_high)[:, None]
    if spec.rejection:
        keep = keep & rejection_keep(old_logprobs - rollout_logprobs, loss_mask, spec.rejection)
    return Correction(out.weights, keep)


def off_policy_sequence_mask(
    logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
    max_kl: float
) -> torch.Tensor:
    """Drop sequences that are both negative and too far off-policy; bool [B] (True = keep).

    ``kl_i = sum_t m_t (logp_mu_t - logp_t) / sum_t m_t`` (the k1 estimate of KL(mu || pi) on mu's own
    samples); sequence i is dropped iff ``A_i < 0`` and ``kl_i > max_kl`` (slime's OPSM,
    ``compute_opsm_mask`` in ``slime/utils/ppo_utils.py``, with ``opsm_delta = max_kl``). ``advantages`` is [B].
    """
    _check(logprobs, rollout_logprobs, loss_mask)
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}")
    trained = loss_mask > 0
    diff = torch.where(trained, rollout_logprobs - logprobs, torch.zeros_like(logprobs)).detach()
    kl = diff.sum(dim=1) / trained.sum(dim=1).clamp(min=1)
    return ~((advantages < 0) & (kl > max_kl))
