"""Per-token policy-gradient losses: PPO clip (with dual clip), GSPO, CISPO, SAPO, DPPO, Clip-Cov, KL-Cov.

Shared contract: ``logprobs`` [B, T] (current policy, carries the gradient), ``old_logprobs`` [B, T]
(the policy the ratio is taken against, no gradient), ``advantages`` [B] (one per sequence) or
[B, T], float ``loss_mask`` [B, T] (1 = trained token). The result's ``per_token`` loss is [B, T]
and 0 where ``loss_mask`` is 0; reduce it with :mod:`megarl.algos.aggregation`. The bool [B, T]
masks mark trained tokens for the clip metrics as the peers count them: ``clipped_low`` /
``clipped_high`` where the ratio was clipped at its lower / upper bound (PPO: where the clipped term
is the larger one, verl's ``pg_clipfrac``), ``dual_clipped`` where PPO's dual clip bound the loss
(verl's ``pg_clipfrac_lower``, AReaL's ``dual_clip_mask``; counted apart from the PPO clip), ``cov_selected``
the tokens Clip-Cov detaches and KL-Cov penalises. CISPO also returns its IS ratio and the clamped weight.
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
    cov_selected: Optional[torch.Tensor] = None  # bool [B, T]: Clip-Cov's detached / KL-Cov's penalised tokens
    ratio: Optional[torch.Tensor] = None  # float [B, T], detached: CISPO's IS ratio pi / pi_old
    ratio_clamped: Optional[torch.Tensor] = None  # float [B, T], detached: CISPO's clamped weight

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
            dual: Optional[torch.Tensor] = None, **extra) -> PolicyLoss:
    none = torch.zeros_like(keep)
    return PolicyLoss(torch.where(keep, loss, torch.zeros_like(loss)), low & keep, high & keep,
                      none if dual is None else dual & keep, **extra)


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
    return _result(loss, keep, ratio < lo, ratio > hi, ratio=ratio, ratio_clamped=weight)


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


DPPO_TYPES = ("binary_tv", "binary_kl")


def dppo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    dppo_type: str = "binary_tv",
    delta_low: float = 0.2,
    delta_high: float = 0.2,
) -> PolicyLoss:
    """DPPO (arXiv 2602.04879): the ratio loss ``L = -r A`` (no clip) on the tokens a binary divergence trust
    region keeps, ``r = exp(clamp(logp - logp_old, -20, 20))``.

    With the probabilities ``p = exp(logp)``, ``mu = exp(logp_old)`` (detached) and ``d = p - mu``:
    ``binary_tv`` (the paper's Eq. 13) drops a token with ``A > 0`` and ``d > delta_high`` or ``A < 0`` and
    ``-d > delta_low``; ``binary_kl`` (Eq. 14) with ``kl = mu (log mu - log p) + (1 - mu) log((1 - mu + 1e-8) /
    (1 - p + 1e-8))`` drops ``A > 0, d > 0, kl > delta_high`` and ``A < 0, d < 0, kl > delta_low``. As SkyRL's
    ``dppo_policy_loss`` (``skyrl/backends/skyrl_train/utils/ppo_utils.py``, config ``dppo.dppo_type``,
    ``delta_low``, ``delta_high``); prime-rl's default loss (``src/prime_rl/trainer/rl/loss.py``,
    ``default_loss_fn``) is the binary-TV mask with ``dppo_mask_low`` / ``dppo_mask_high``. The behaviour policy
    is the old one here (``algorithm.old_policy=rollout``: the engine's, the paper's Section 5.2 choice and
    prime-rl's; SkyRL takes the rollout's when it has them). Dropped tokens count as clipped: high (A > 0)
    or low (A < 0).
    """
    if dppo_type not in DPPO_TYPES:
        raise ValueError(f"unknown dppo_type {dppo_type!r}; valid: {', '.join(DPPO_TYPES)}")
    if delta_low < 0 or delta_high < 0:
        raise ValueError(f"DPPO deltas must be >= 0, got delta_low={delta_low}, delta_high={delta_high}")
    log_ratio, adv, keep = _prepare(logprobs, old_logprobs, advantages, loss_mask)
    with torch.no_grad():
        p, mu = logprobs.detach().exp(), old_logprobs.detach().exp()
        diff = p - mu
        if dppo_type == "binary_tv":
            high, low = (adv > 0) & (diff > delta_high), (adv < 0) & (-diff > delta_low)
        else:
            kl = mu * (old_logprobs.detach() - logprobs.detach()) + (1 - mu) * torch.log(
                (1 - mu + 1e-8) / (1 - p + 1e-8))
            high, low = (adv > 0) & (diff > 0) & (kl > delta_high), (adv < 0) & (diff < 0) & (kl > delta_low)
    ratio = log_ratio.clamp(-20.0, 20.0).exp()
    loss = torch.where(high | low, torch.zeros_like(ratio), -ratio * adv)
    return _result(loss, keep, low, high)


def _masked_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, values, torch.zeros_like(values)).sum() / keep.sum().clamp(min=1)


@dataclass(frozen=True)
class CovBand:
    """Clip-Cov's choice: at most ``ratio`` of the trained tokens (at least one), among those of covariance in
    (``lower``, ``upper``) (verl's ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub`` and their defaults)."""

    ratio: float = 2e-4
    lower: float = 1.0
    upper: float = 5.0


def clip_cov(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    band: CovBand = CovBand(),
    generator: Optional[torch.Generator] = None,
) -> PolicyLoss:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"): PPO clip, and a few
    high-covariance tokens detached.

    verl's ``compute_policy_loss_clip_cov`` (``verl/trainer/ppo/core_algos.py``; SkyRL's is the same): with
    ``cov_t = (A_t - mean(A)) (logp_t - mean(logp))`` over the trained tokens, the tokens with
    ``band.lower < cov_t < band.upper`` that PPO did not clip are candidates; ``max(int(band.ratio * n), 1)`` of
    them (n the trained tokens), a uniformly random choice (``torch.randperm`` on ``generator``, None: torch's
    default, as verl) when there are more, get ``L_t = 0``; the others PPO's ``max(-A r, -A clip(r, 1 - clip_low,
    1 + clip_high))`` (no dual clip). The detached tokens are ``cov_selected`` (verl's ``pg_clipfrac`` for this
    loss); ``clipped_*`` is the PPO clip.
    """
    if not band.ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {band.ratio}")
    out = ppo(logprobs, old_logprobs, advantages, loss_mask, clip_low, clip_high)
    _, adv, keep = _prepare(logprobs, old_logprobs, advantages, loss_mask)
    with torch.no_grad():
        lp = logprobs.detach()
        cov = (adv - _masked_mean(adv, keep)) * (lp - _masked_mean(lp, keep))
        candidates = ((cov > band.lower) & (cov < band.upper) & keep & ~out.clipped).nonzero()
        count = max(int(band.ratio * int(keep.sum())), 1)
        if len(candidates) > count:
            candidates = candidates[torch.randperm(len(candidates), generator=generator,
                                                   device=candidates.device)[:count]]
        selected = torch.zeros_like(keep)
        selected[candidates[:, 0], candidates[:, 1]] = True
    out.per_token = torch.where(selected, torch.zeros_like(out.per_token), out.per_token)
    out.cov_selected = selected
    return out


def kl_cov(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    ratio: float = 2e-4,
    coef: float = 1.0,
) -> PolicyLoss:
    """KL-Cov (Cui et al. 2025): the unclipped ratio loss ``-A r``, plus ``coef * |logp - logp_old|`` on the
    ``max(int(ratio * n), 1)`` trained tokens of largest ``cov_t = (A_t - mean(A)) (logp_t - mean(logp))``
    (``torch.topk``; n the trained tokens).

    verl's ``compute_policy_loss_kl_cov`` (``verl/trainer/ppo/core_algos.py``, ``kl_cov_ratio``, ``ppo_kl_coef``);
    SkyRL's (``kl_cov_frac``) is the same. Nothing is clipped; the penalised tokens are ``cov_selected``.
    """
    if not ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {ratio}")
    log_ratio, adv, keep = _prepare(logprobs, old_logprobs, advantages, loss_mask)
    loss = -adv * log_ratio.exp()
    selected = torch.zeros_like(keep)
    with torch.no_grad():
        flat = keep.reshape(-1).nonzero().squeeze(1)
        if len(flat):
            a, lp = adv.reshape(-1)[flat], logprobs.detach().reshape(-1)[flat]
            cov = (a - a.mean()) * (lp - lp.mean())
            top = flat[torch.topk(cov, min(max(int(len(flat) * ratio), 1), len(flat))).indices]
            selected.view(-1)[top] = True
    loss = torch.where(selected, loss + coef * log_ratio.abs(), loss)
    none = torch.zeros_like(keep)
    return _result(loss, keep, none, none, cov_selected=selected)


POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo": ppo, "gspo": gspo, "cispo": cispo, "sapo": sapo, "dppo": dppo,
                                          "clip_cov": clip_cov, "kl_cov": kl_cov}


def policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss ``AlgorithmConfig.policy_loss`` names."""
    return choose(POLICY_LOSSES, name, "policy_loss")
