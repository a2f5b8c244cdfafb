"""The RL training loss as ``AlgorithmConfig`` selects it.

``loss = agg(w * L_pg) + kl_coef * agg(KL) - entropy_coef * agg(H)``, with ``L_pg`` the per-token
policy loss, ``w`` the off-policy importance weight, KL the per-token estimator to the reference
model, H the per-token entropy (the entropy bonus), all reduced by the same aggregation ``agg`` under
the same mask: the trained tokens less the rejected ones (``off_policy_correction=mis``,
``off_policy_rejection``, the vetoes, ``off_policy_mask_kl``), which leave the numerators (and the
denominators of the aggregations that count after rejection, :mod:`megarl.algos.aggregation`).
With ``score_centering``, ``agg(g * (C - sg(C)))`` joins it: C the token's centering term, g its score
coefficient in ``w * L_pg`` (:mod:`megarl.algos.score_centering`): no value, the centred gradient.

The PPO ratio's old policy is ``old_logprobs`` (``algorithm.old_policy``: the trainer's log-probs before the
step's first update, or the engine's). The off-policy correction compares the trainer with the engine:
the old policy under ``recompute``; the current policy (detached) under ``rollout``, where the ratio to the
engine's policy is the PPO ratio itself and no importance weight is applied (verl's bypass mode,
``compute_policy_loss_bypass_mode``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megarl.algos.aggregation import aggregation_fn
from megarl.algos.is_diagnostics import diagnostic_sums
from megarl.algos.kl import kl_penalty
from megarl.algos.off_policy import CorrectionSpec, correction, off_policy_sequence_mask
from megarl.algos.policy_loss import CovBand, PolicyLoss, policy_loss_fn
from megarl.algos.rejection import parse_criteria
from megarl.algos.score_centering import Centering
from megarl.algos.settings import AlgorithmConfig


@dataclass
class LossInputs:
    """One batch of per-token tensors, all [B, T] except ``advantages`` ([B] or [B, T]) and ``row_weights`` [B]."""

    logprobs: torch.Tensor  # current policy, carries the gradient
    old_logprobs: torch.Tensor  # the PPO ratio's old policy (algorithm.old_policy)
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # float, 1 = trained token
    entropy: Optional[torch.Tensor] = None  # needed when entropy_coef != 0
    ref_logprobs: Optional[torch.Tensor] = None  # needed when kl_coef != 0
    rollout_logprobs: Optional[torch.Tensor] = None  # needed when off_policy_correction != none or a rejection is on
    row_weights: Optional[torch.Tensor] = None  # loss_agg=prompt_mean: aggregation.prompt_mean_weights of the rows
    centering: Optional[Centering] = None  # score_centering != none: its [B, T] terms (0 off the trained tokens)


@dataclass
class LossOutput:
    """The loss of one (micro-)batch in parts that add up over micro-batches and DP ranks.

    ``loss_sum``: differentiable scalar, the aggregation's numerator over this batch's kept tokens
    (trained and not rejected). ``denominator_share``: scalar, this batch's part of the global denominator:
    kept tokens (token_mean), sequences with at least one kept token (seq_mean_token_mean, seq_mean_token_sum),
    rows x loss_scale_factor (seq_mean_token_sum_norm), rows (prompt_mean).
    The batch loss is ``sum(loss_sum) / sum(denominator_share)`` over all parts (megatron's
    ``calculate_per_token_loss`` divides so). ``loss``: ``loss_sum / denominator_share`` (a single batch;
    a denominator below 1 counts as 1). ``trained_tokens`` / ``trained_sequences``: scalars, this batch's
    tokens with ``loss_mask > 0`` and sequences with at least one, before rejection.

    ``sums``: detached scalars, each this batch's part of a metric's numerator; sum each over all parts,
    then divide:

    - by ``sum(denominator_share)``: ``pg_loss`` (policy term, IS-weighted), ``kl`` (when kl_coef != 0 and
      the KL is in the loss), ``entropy`` (when entropy_coef != 0): the aggregated terms of the loss;
    - by ``sum(trained_tokens)``: ``clip_fraction`` (ratio clipped at either bound), ``clip_fraction_low``,
      ``clip_fraction_high``, ``dual_clip_fraction`` (counted apart from the clip; rejected tokens count
      as not clipped), ``cov_fraction`` (Clip-Cov's detached, KL-Cov's penalised tokens), ``is_weight_mean``
      (the weight ``w`` applied, 0 for a rejected token), ``rejected_tokens``, ``ppo_kl`` (``logp_old - logp``,
      verl's ``actor/ppo_kl``: how far the policy moved from the old one), ``score_centering/*`` (support TV
      and head mass, with score centering) and :data:`megarl.algos.is_diagnostics.TOKEN_SUMS` (with
      rollout_logprobs);
    - by ``sum(kept_tokens)`` (tokens in the loss, after rejection): ``cispo/ratio_mean`` and
      ``cispo/ratio_clamped_mean`` (policy_loss=cispo);
    - by ``sum(trained_sequences)``: ``rejected_sequences`` (sequences with trained tokens and none kept) and
      :data:`megarl.algos.is_diagnostics.SEQUENCE_SUMS` (with rollout_logprobs).

    ``maxima``: detached scalars reduced by their maximum over all parts (-inf over no token), a ``*_min``
    negated: :data:`megarl.algos.is_diagnostics.MAXIMA`, ``cispo/ratio_max`` and ``cispo/ratio_min``.
    """

    loss_sum: torch.Tensor
    denominator_share: torch.Tensor
    loss: torch.Tensor
    sums: dict[str, torch.Tensor]
    trained_tokens: torch.Tensor
    trained_sequences: torch.Tensor
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)


def _policy_kwargs(cfg: AlgorithmConfig) -> dict:
    """The settings of ``cfg`` the configured policy loss takes."""
    if cfg.dual_clip is not None and cfg.policy_loss != "ppo":
        raise ValueError(f"dual_clip applies to the ppo policy loss only, not {cfg.policy_loss}")
    if cfg.clip_absolute and cfg.policy_loss != "cispo":
        raise ValueError(f"clip_absolute applies to the cispo policy loss only, not {cfg.policy_loss}")
    if cfg.policy_loss == "sapo":
        return {"tau_pos": cfg.sapo_tau_pos, "tau_neg": cfg.sapo_tau_neg}
    if cfg.policy_loss == "dppo":
        return {"dppo_type": cfg.dppo_type, "delta_low": cfg.dppo_delta_low, "delta_high": cfg.dppo_delta_high}
    if cfg.policy_loss == "kl_cov":
        return {"ratio": cfg.kl_cov_ratio, "coef": cfg.kl_cov_coef}
    kwargs = {"clip_low": cfg.clip_low, "clip_high": cfg.clip_high}
    if cfg.policy_loss == "ppo":
        kwargs["dual_clip"] = cfg.dual_clip
    if cfg.policy_loss == "cispo":
        kwargs["absolute"] = cfg.clip_absolute
    if cfg.policy_loss == "clip_cov":
        kwargs["band"] = CovBand(cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub)
    return kwargs


def _batch_generator(mask: torch.Tensor) -> torch.Generator:
    """Clip-Cov's random draw, seeded from the batch's rows and kept tokens: every tensor-parallel rank computes
    the whole loss of the micro-batch and must draw the same tokens (the vocab-parallel backward needs one
    upstream gradient on all of them), which torch's default generator does not promise."""
    return torch.Generator(device=mask.device).manual_seed(int((mask > 0).sum()) * 1_000_003 + mask.shape[0])


def _count(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return flags.sum().to(like.dtype)


def _correction_inputs(batch: LossInputs, cfg: AlgorithmConfig) -> torch.Tensor:
    """The trainer's side of the off-policy correction (module docstring), [B, T], detached."""
    if cfg.old_policy == "rollout":
        if cfg.off_policy_correction != "none":
            raise ValueError(f"off_policy_correction={cfg.off_policy_correction} weighs by the old/rollout ratio, "
                             "which is 1 under old_policy=rollout (the PPO ratio is the correction); use "
                             "off_policy_rejection or the vetoes")
        return batch.logprobs.detach()
    return batch.old_logprobs.detach()


def _keep(batch: LossInputs, cfg: AlgorithmConfig, trainer_logprobs: torch.Tensor):
    """The configured correction and its keep mask, with ``off_policy_mask_kl`` applied."""
    criteria = parse_criteria(cfg.off_policy_rejection, cfg.off_policy_rejection_threshold) \
        if cfg.off_policy_rejection else ()
    spec = CorrectionSpec(cfg.off_policy_correction, cfg.off_policy_level, cfg.is_threshold, cfg.is_threshold_low,
                          cfg.off_policy_veto_threshold, cfg.off_policy_veto_threshold_high, criteria)
    corrected = correction(trainer_logprobs, batch.rollout_logprobs, batch.loss_mask, spec)
    keep = corrected.keep
    if cfg.off_policy_mask_kl is not None:
        if batch.rollout_logprobs is None or batch.advantages.dim() != 1:
            raise ValueError("off_policy_mask_kl needs rollout_logprobs and per-sequence advantages [B]")
        keep = keep & off_policy_sequence_mask(trainer_logprobs, batch.rollout_logprobs, batch.advantages,
                                               batch.loss_mask, cfg.off_policy_mask_kl)[:, None]
    return corrected, keep


def _score_coefficients(pg_weighted: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """``g = -d(sum w L_pg)/d logp`` per token [B, T], detached: each token's policy loss depends on its own
    log-prob only (the sequence ratios are detached), so this is the coefficient of its score."""
    if not logprobs.requires_grad:
        return torch.zeros_like(logprobs)
    (grad,) = torch.autograd.grad(pg_weighted.sum(), logprobs, retain_graph=True, allow_unused=True)
    return torch.zeros_like(logprobs) if grad is None else -grad.detach()


def _centred(batch: LossInputs, pg_weighted: torch.Tensor, mask: torch.Tensor, agg, sums: dict) -> torch.Tensor:
    """The score-centering part of the loss: ``agg(g * (C - sg(C)))`` (value 0, module docstring); its metrics
    go into ``sums`` (over the trained tokens)."""
    c = batch.centering
    if not c.term.shape == c.support_tv.shape == c.head_mass.shape == mask.shape:
        raise ValueError(f"the centering terms must be [B, T] = {tuple(mask.shape)}, got {tuple(c.term.shape)}")
    trained = batch.loss_mask > 0
    sums["score_centering/support_tv"] = torch.where(trained, c.support_tv, torch.zeros_like(mask)).sum().detach()
    sums["score_centering/head_mass"] = torch.where(trained, c.head_mass, torch.zeros_like(mask)).sum().detach()
    g = _score_coefficients(pg_weighted, batch.logprobs)
    centred, _ = agg(g * (c.term - c.term.detach()), mask)
    return centred


def _policy_sums(pg: PolicyLoss, weights: torch.Tensor, batch: LossInputs, keep: torch.Tensor,
                 mask: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The policy term's metric sums and maxima (:class:`LossOutput`)."""
    trained = batch.loss_mask > 0
    trained_sequences = trained.any(dim=1)
    sums = {
        "clip_fraction": _count(pg.clipped & trained, mask),
        "clip_fraction_low": _count(pg.clipped_low & trained, mask),
        "clip_fraction_high": _count(pg.clipped_high & trained, mask),
        "dual_clip_fraction": _count(pg.dual_clipped & trained, mask),
        "cov_fraction": _count(pg.cov_selected & trained, mask) if pg.cov_selected is not None else mask.new_zeros(()),
        "is_weight_mean": (weights * mask).sum().detach(),
        "rejected_tokens": _count(trained & ~keep, mask),
        "rejected_sequences": _count(trained_sequences & ~(trained & keep).any(dim=1), mask),
        "ppo_kl": torch.where(trained, batch.old_logprobs - batch.logprobs, torch.zeros_like(mask)).sum().detach(),
        "kept_tokens": _count(mask > 0, mask),
    }
    maxima = {}
    if pg.ratio is not None:
        kept = mask > 0
        none = torch.tensor(-float("inf"), dtype=mask.dtype, device=mask.device)
        sums["cispo/ratio_mean"] = torch.where(kept, pg.ratio, torch.zeros_like(mask)).sum()
        sums["cispo/ratio_clamped_mean"] = torch.where(kept, pg.ratio_clamped, torch.zeros_like(mask)).sum()
        maxima["cispo/ratio_max"] = pg.ratio[kept].max() if kept.any() else none
        maxima["cispo/ratio_min"] = (-pg.ratio[kept]).max() if kept.any() else none
    return sums, maxima


def _penalties(batch: LossInputs, cfg: AlgorithmConfig, agg, mask: torch.Tensor, sums: dict) -> torch.Tensor:
    """The KL (in the loss) and entropy terms, 0 without them; their sums go into ``sums``."""
    total = mask.new_zeros(())
    if cfg.kl_coef != 0.0 and not cfg.kl_in_reward:  # in the reward, it is in the advantages already
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs ref_logprobs")
        kl_sum, _ = agg(kl_penalty(cfg.kl_type, batch.logprobs, batch.ref_logprobs, batch.old_logprobs), mask)
        total = total + cfg.kl_coef * kl_sum
        sums["kl"] = kl_sum.detach()
    if cfg.entropy_coef != 0.0:
        if batch.entropy is None:
            raise ValueError("entropy_coef != 0 needs entropy")
        entropy_sum, _ = agg(batch.entropy, mask)
        total = total - cfg.entropy_coef * entropy_sum
        sums["entropy"] = entropy_sum.detach()
    return total


def rl_loss(batch: LossInputs, cfg: AlgorithmConfig) -> LossOutput:
    """The configured loss of one (micro-)batch; ``cfg`` is the ``algorithm`` section of the config
    (``megarl.algos.settings.AlgorithmConfig``)."""
    trained = batch.loss_mask > 0
    trainer_logprobs = _correction_inputs(batch, cfg)
    corrected, keep = _keep(batch, cfg, trainer_logprobs)
    mask = batch.loss_mask * keep
    agg = aggregation_fn(cfg.loss_agg, cfg.loss_scale_factor if cfg.loss_agg == "seq_mean_token_sum_norm" else None,
                         batch.row_weights)
    kwargs = _policy_kwargs(cfg)
    if cfg.policy_loss == "clip_cov":
        kwargs["generator"] = _batch_generator(mask)
    pg = policy_loss_fn(cfg.policy_loss)(batch.logprobs, batch.old_logprobs, batch.advantages, mask, **kwargs)
    pg_weighted = corrected.weights * pg.per_token
    pg_sum, denominator = agg(pg_weighted, mask)
    sums, maxima = _policy_sums(pg, corrected.weights, batch, keep, mask)
    sums["pg_loss"] = pg_sum.detach()
    loss_sum = pg_sum
    if cfg.score_centering != "none":
        if batch.centering is None:
            raise ValueError(f"score_centering={cfg.score_centering} needs the centering terms of the batch")
        loss_sum = loss_sum + _centred(batch, pg_weighted, mask, agg, sums)
    if batch.rollout_logprobs is not None:
        found, extremes = diagnostic_sums(trainer_logprobs, batch.rollout_logprobs, batch.loss_mask, cfg.is_threshold)
        sums |= found
        maxima |= extremes
    loss_sum = loss_sum + _penalties(batch, cfg, agg, mask, sums)
    return LossOutput(loss_sum=loss_sum, denominator_share=denominator, loss=loss_sum / denominator.clamp(min=1),
                      sums=sums, trained_tokens=_count(trained, mask),
                      trained_sequences=_count(trained.any(dim=1), mask), maxima=maxima)
