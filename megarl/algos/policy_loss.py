"""Per-token policy-gradient losses: PPO clip (with dual clip), GSPO, CISPO, SAPO.

Shared contract: ``logprobs`` [B, T] (current policy, carries the gradient), ``old_logprobs`` [B, T]
(the policy the ratio is taken against, no gradient), ``advantages`` [B] (one per sequence) or
[B, T], float ``loss_mask`` [B, T] (1 = trained token). The result's ``per_token`` loss is [B, T]
and 0 where ``loss_mask`` is 0; reduce it with :mod:`megarl.algos.aggregation`. The bool [B, T]
masks mark trained tokens for the clip metrics as the peers count them: ``clipped_low`` /
``clipped_high`` where the ratio was clipped at its lower / upper bound (PPO: where the clipped term
is the larger one, verl's ``pg_clipfrac``), ``dual_clipped`` where PPO's dual clip bound the loss
(verl's ``pg_clipfrac_lower``, AReaL's ``dual_clip_mask``; counted apart from the PPO clip).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megarl.algos.registry import choose


@dataclass
class PolicyLoss:
    per_token: torch.Tensor  # float [B, T], 0 where loss_mask == 0
    clipped_low: torch.Tensor  # bool [B, T]: ratio clipped at its lower bound
    clipped_high: torch.Tensor  # bool [B, T]: ratio clipped at its upper bound
    dual_clipped: torch.Tensor  # bool [B, T]: PPO dual clip active (A < 0, ratio above dual_clip)

    @property
    def clipped(self) -> torch.Tensor:
        """bool [B, T]: ratio clipped at either bound (the clip-fraction numerator)."""
        return self.clipped_low | self.clipped_high


PolicyLossFn = Callable[..., PolicyLoss]


def _prepare(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
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
    keep = loss_mask > 0
    log_ratio = torch.where(keep, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    return log_ratio, advantages, keep


def _relative_range(clip_low: float, clip_high: float) -> tuple[float, float]:
    """The ratio band ``[1 - clip_low, 1 + clip_high]``, checked."""
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    return 1.0 - clip_low, 1.0 + clip_high


def _result(loss: torch.Tensor, keep: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
            dual: Optional[torch.Tensor] = None) -> PolicyLoss:
    none = torch.zeros_like(keep)
    return PolicyLoss(torch.where(keep, loss, torch.zeros_like(loss)), low & keep, high & keep,
                      none if dual is None else dual & keep)


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
    As verl's ``compute_policy_loss_vanilla`` (``verl/trainer/ppo/core_algos.py``) and slime's
    ``compute_policy_loss`` (``slime/utils/ppo_utils.py``); clipped = ``-A clip(r) > -A r``, split by
    ``r < 1`` (low) and ``r > 1`` (high); dual clipped = ``A < 0 and L > -c A``.
    """
    lo, hi = _relative_range(clip_low, clip_high)
    log_ratio, adv, keep = _prepare(logprobs, old_logprobs, advantages, loss_mask)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped_loss = -adv * ratio.clamp(lo, hi)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    dual = None
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -adv * dual_clip
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return _result(loss, keep, clipped & (ratio < 1.0), clipped & (ratio > 1.0), dual)


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> PolicyLoss:
    """GSPO: PPO clip on the length-normalised sequence ratio (default range: the GSPO paper's).

    ``s_i = exp(sum_t m_t (logp_t - logp_old_t) / sum_t m_t)``; per token
    ``L_t = max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high))`` with the GSPO-token ratio
    ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))``: its value is ``s_i`` and its gradient ``s_i grad logp_t``,
    so every token of a sequence gets the same gradient ``-A s_i`` (times the aggregation weight),
    which is exactly GSPO's sequence-level gradient for a per-sequence advantage.
    """
    lo, hi = _relative_range(clip_low, clip_high)
    log_ratio, adv, keep = _prepare(logprobs, old_logprobs, advantages, loss_mask)
    lengths = keep.sum(dim=1).clamp(min=1)
    seq_log_ratio = log_ratio.sum(dim=1) / lengths
    token_ratio = (seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()).exp()
    unclipped = -adv * token_ratio
    clipped_loss = -adv * token_ratio.clamp(lo, hi)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    seq_log = seq_log_ratio.detach()[:, None].expand_as(loss)
    return _result(loss, keep, clipped & (seq_log < 0), clipped & (seq_log > 0))


def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    absolute: bool = False,
) -> PolicyLoss:
    """CISPO: REINFORCE weighted by the clipped, detached importance ratio.

    ``L_t = -sg(clip(r_t, lo, hi)) A_t logp_t``. The ratio carries no gradient, so every token (clipped or
    not) gets gradient ``-clip(r_t) A_t`` w.r.t. ``logp_t``. Bounds relative to 1 by default,
    ``[lo, hi] = [1 - clip_low, 1 + clip_high]`` as verl's ``compute_policy_loss_cispo``
    (``verl/trainer/ppo/core_algos.py``) and slime's ``compute_cispo_loss`` (``slime/utils/ppo_utils.py``);
    ``absolute`` takes ``[lo, hi] = [clip_low, clip_high]``, the IS-weight bounds themselves, so the lower
    bound may be 0 (MiniMax-M1's "no lower bound"; the Tinker-style ``clip_low_threshold`` /
    ``clip_high_threshold`` of pan-x-c/TuFT ``src/tuft/loss_fn/cispo.py``). Needs ``lo <= 1 <= hi`` there.
    """
    if absolute:
        if not 0.0 <= clip_low <= 1.0 <= clip_high:
            raise ValueError(f"absolute CISPO bounds need 0 <= clip_low <= 1 <= clip_high, got {clip_low}, {clip_high}")
        lo, hi = clip_low, clip_high
    else:
        lo, hi = _relative_range(clip_low, clip_high)
    log_ratio, adv, keep = _prepare(logprobs, old_logprobs, advantages, loss_mask)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(lo, hi)
    loss = -weight * adv * logprobs
    return _result(loss, keep, ratio < lo, ratio > hi)


def sapo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> PolicyLoss:
    """SAPO: PPO's hard clip replaced by a soft sigmoid gate.

    ``L_t = -f_tau(r_t) A_t`` with ``f_tau(r) = sigmoid(tau (r - 1)) * 4 / tau``, ``tau = tau_pos`` if
    ``A_t > 0`` else ``tau_neg``, ``r_t = exp(clamp(logp_t - logp_old_t, -20, 20))``. Its gradient is
    ``-A_t r_t 4 s (1 - s)`` (``s`` the sigmoid): ``-A_t`` at ``r = 1``, fading smoothly away from it.
    As verl's ``compute_policy_loss_sapo`` (``verl/trainer/ppo/core_algos.py``, ``tau_pos`` / ``tau_neg``,
    defaults 1.0 / 1.05) and AReaL's ``sapo_loss_fn`` (``areal/utils/functional/functional.py``,
    ``sapo_tau_pos`` / ``sapo_tau_neg``); slime has no SAPO. verl always reduces SAPO with
    seq-mean-token-mean, AReaL with token-mean; here the configured ``loss_agg`` does. Nothing is clipped.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    log_ratio, adv, keep = _prepare(logprobs, old_logprobs, advantages, loss_mask)
    ratio = log_ratio.clamp(-20.0, 20.0).exp()
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    none = torch.zeros_like(keep)
    return _result(loss, keep, none, none)


POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo": ppo, "gspo": gspo, "cispo": cispo, "sapo": sapo}


def policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss ``AlgorithmConfig.policy_loss`` names."""
    return choose(POLICY_LOSSES, name, "policy_loss")
