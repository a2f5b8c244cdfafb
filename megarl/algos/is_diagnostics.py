"""Diagnostics of the importance weights between the trainer and the rollout engine, as sums and maxima that
add up (sums) or reduce (maxima) over micro-batches and data-parallel ranks.

With ``l_t = logp_train_t - logp_rollout_t`` over the trained tokens (``loss_mask > 0``) of a [B, T] batch, N
trained tokens and S sequences with at least one, ``rho = exp(clamp(l, -20, 20))``, C = ``algorithm.is_threshold``
and ``w = clamp(rho, 1/C, C)``, the metrics are verl's (``verl/trainer/ppo/rollout_corr_helper.py``:
``compute_is_metrics`` at its token level, ``compute_offpolicy_metrics``):

- ``rollout_is_mean``, ``rollout_is_max``, ``rollout_is_min``: of rho over the trained tokens;
  ``rollout_is_std``: ``sqrt(max(mean(w^2) - mean(w)^2, 0))`` (0 for one token);
  ``rollout_is_ratio_fraction_high`` / ``_low``: the share of tokens with rho > C / rho < 1/C;
- ``ess``: the effective sample size of w as a share of N, ``(sum w)^2 / (N sum w^2)`` (verl's
  ``rollout_is_eff_sample_size``, ``1 / mean((w / mean w)^2)``);
- ``kl``: ``mean_t(-l_t)`` and ``k3_kl``: ``mean_t(exp(l_t) - l_t - 1)``, estimates of KL(rollout || train);
- ``training_ppl`` / ``rollout_ppl``: ``mean_seq exp(-mean_t logp)`` of the trainer's / the engine's log-probs;
  ``log_ppl_diff``: ``mean_seq d`` with ``d = mean_t(logp_rollout - logp_train)`` (signed: > 0 where the trainer
  finds the sequence less likely), ``log_ppl_diff_max`` / ``_min`` its extremes over the sequences,
  ``log_ppl_abs_diff``: ``mean_seq |d|``; ``ppl_ratio``: ``mean_seq exp(d)``;
- ``chi2_token``: ``mean_t rho_t^2 - 1`` and ``chi2_seq``: ``mean_seq (prod_t rho_t)^2 - 1`` (the sequence's
  log-ratio sum clamped to +-20): the chi-square divergence, the variance of the token and sequence weights.

verl averages the sequence metrics over every row of its batch; here over the S sequences that have a
trained token (the same batch when every row has one).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

SAFETY_BOUND = 20.0
# summed over trained tokens
TOKEN_SUMS = ("is_w", "is_w_sq", "is_kl", "is_k3", "is_rho", "is_rho_sq", "is_above", "is_below")
# summed over trained sequences
SEQUENCE_SUMS = ("is_ppl_ratio", "is_log_ppl_diff", "is_log_ppl_abs_diff", "is_rho_seq_sq", "is_training_ppl",
                 "is_rollout_ppl")
# reduced by their maximum; a ``_min`` is kept negated (its maximum is minus the minimum)
MAXIMA = ("is_rho_max", "is_rho_min", "is_log_ppl_diff_max", "is_log_ppl_diff_min")


def _masked_rows(values: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Per-row means over the trained tokens of [B, T] ``values`` (0 for a row without any)."""
    return torch.where(trained, values, torch.zeros_like(values)).sum(dim=1) / trained.sum(dim=1).clamp(min=1)


def diagnostic_sums(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                    threshold: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Detached float64 scalar sums (:data:`TOKEN_SUMS`, :data:`SEQUENCE_SUMS`) and maxima (:data:`MAXIMA`, -inf over no
    token) over one [B, T] batch (float log-probs, float ``loss_mask``); ``threshold`` is C (>= 1)."""
    trained = loss_mask > 0
    # float64: the std's and chi-square's differences of sums cancel, float32 leaves ~1e-4 of noise in a 0 std
    train, rollout = trainer_logprobs.detach().double(), rollout_logprobs.detach().double()
    lr = torch.where(trained, train - rollout, torch.zeros_like(train))
    zero = torch.zeros_like(lr)
    rho = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    w = rho.clamp(1.0 / threshold, threshold)
    tokens = {"is_w": w, "is_w_sq": w * w, "is_kl": -lr, "is_k3": torch.expm1(lr) - lr, "is_rho": rho,
              "is_rho_sq": rho * rho, "is_above": (rho > threshold).to(lr.dtype),
              "is_below": (rho < 1.0 / threshold).to(lr.dtype)}
    sums = {k: torch.where(trained, v, zero).sum() for k, v in tokens.items()}
    has = trained.sum(dim=1) > 0
    diff = -_masked_rows(lr, trained)  # mean_t(logp_rollout - logp_train)
    log_sum = lr.sum(dim=1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    sequences = {"is_ppl_ratio": diff.exp(), "is_log_ppl_diff": diff, "is_log_ppl_abs_diff": diff.abs(),
                 "is_rho_seq_sq": (2.0 * log_sum).exp(), "is_training_ppl": (-_masked_rows(train, trained)).exp(),
                 "is_rollout_ppl": (-_masked_rows(rollout, trained)).exp()}
    sums |= {k: v[has].sum() for k, v in sequences.items()}
    none = torch.tensor(-math.inf, dtype=lr.dtype, device=lr.device)
    maxima = {"is_rho_max": rho[trained].max() if trained.any() else none,
              "is_rho_min": (-rho[trained]).max() if trained.any() else none,
              "is_log_ppl_diff_max": diff[has].max() if has.any() else none,
              "is_log_ppl_diff_min": (-diff[has]).max() if has.any() else none}
    return sums, maxima


def diagnostics(totals: Mapping[str, float], maxima: Mapping[str, float], tokens: float,
                sequences: float) -> dict[str, float]:
    """The metrics (module docstring) from the summed :func:`diagnostic_sums`, their reduced maxima and the
    counts of trained tokens and sequences; empty over no token."""
    if tokens <= 0 or sequences <= 0:
        return {}
    mean_w = totals["is_w"] / tokens
    return {"ess": totals["is_w"] ** 2 / (tokens * totals["is_w_sq"]), "kl": totals["is_kl"] / tokens,
            "k3_kl": totals["is_k3"] / tokens, "chi2_token": totals["is_rho_sq"] / tokens - 1.0,
            "rollout_is_mean": totals["is_rho"] / tokens, "rollout_is_max": maxima["is_rho_max"],
            "rollout_is_min": -maxima["is_rho_min"],
            "rollout_is_std": math.sqrt(max(totals["is_w_sq"] / tokens - mean_w ** 2, 0.0)) if tokens > 1 else 0.0,
            "rollout_is_ratio_fraction_high": totals["is_above"] / tokens,
            "rollout_is_ratio_fraction_low": totals["is_below"] / tokens,
            "ppl_ratio": totals["is_ppl_ratio"] / sequences,
            "log_ppl_diff": totals["is_log_ppl_diff"] / sequences,
            "log_ppl_diff_max": maxima["is_log_ppl_diff_max"], "log_ppl_diff_min": -maxima["is_log_ppl_diff_min"],
            "log_ppl_abs_diff": totals["is_log_ppl_abs_diff"] / sequences,
            "training_ppl": totals["is_training_ppl"] / sequences, "rollout_ppl": totals["is_rollout_ppl"] / sequences,
            "chi2_seq": totals["is_rho_seq_sq"] / sequences - 1.0}
