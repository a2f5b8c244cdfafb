"""Diagnostics of the importance weights between the trainer and the rollout engine, as sums that add
up over micro-batches and data-parallel ranks.

With ``l_t = logp_train_t - logp_rollout_t`` over the trained tokens (``loss_mask > 0``) of a [B, T]
batch, N trained tokens and S sequences with at least one, the metrics are verl's
(``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_is_metrics``, ``compute_offpolicy_metrics``):

- ``ess``: the effective sample size of the token weights, as a share of N:
  ``(sum w)^2 / (N sum w^2)`` with ``w = clamp(exp(l), 1/C, C)`` (verl's ``rollout_is_eff_sample_size``,
  ``1 / mean((w / mean w)^2)``; C its ``rollout_is_threshold``, here ``algorithm.is_threshold``);
- ``kl``: ``mean_t(-l_t)`` and ``k3_kl``: ``mean_t(exp(l_t) - l_t - 1)``, estimates of KL(rollout || train);
- ``ppl_ratio``: ``mean_seq exp(mean_t(-l_t))``, the trainer's perplexity over the rollout's per sequence,
  averaged (``ppl_ratio``); ``log_ppl_abs_diff``: ``mean_seq |mean_t l_t|``;
- ``chi2_token``: ``mean_t rho_t^2 - 1`` and ``chi2_seq``: ``mean_seq (prod_t rho_t)^2 - 1`` with
  ``rho = exp(clamp(l, -20, 20))`` (the sequence's log-ratio sum clamped likewise): the chi-square
  divergence, the variance of the token and sequence importance weights.

verl averages the sequence metrics over every row of its batch; here over the S sequences that have a
trained token (the same batch when every row has one).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

SAFETY_BOUND = 20.0
TOKEN_SUMS = ("is_w", "is_w_sq", "is_kl", "is_k3", "is_rho_sq")  # summed over trained tokens
SEQUENCE_SUMS = ("is_ppl_ratio", "is_log_ppl_abs_diff", "is_rho_seq_sq")  # summed over trained sequences


def diagnostic_sums(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                    threshold: float) -> dict[str, torch.Tensor]:
    """Detached scalar sums of :data:`TOKEN_SUMS` and :data:`SEQUENCE_SUMS` over one [B, T] batch (float
    log-probs, float ``loss_mask``); ``threshold`` is C (>= 1) of the ESS's clamp."""
    trained = loss_mask > 0
    lr = torch.where(trained, trainer_logprobs.detach() - rollout_logprobs.detach(), torch.zeros_like(loss_mask))
    zero = torch.zeros_like(lr)
    w = lr.exp().clamp(1.0 / threshold, threshold)
    rho = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    tokens = {"is_w": w, "is_w_sq": w * w, "is_kl": -lr, "is_k3": torch.expm1(lr) - lr, "is_rho_sq": rho * rho}
    out = {k: torch.where(trained, v, zero).sum() for k, v in tokens.items()}
    counts = trained.sum(dim=1)
    has = counts > 0
    mean_l = lr.sum(dim=1) / counts.clamp(min=1)
    log_sum = lr.sum(dim=1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    sequences = {"is_ppl_ratio": (-mean_l).exp(), "is_log_ppl_abs_diff": mean_l.abs(),
                 "is_rho_seq_sq": (2.0 * log_sum).exp()}
    out |= {k: v[has].sum() for k, v in sequences.items()}
    return out


def diagnostics(totals: Mapping[str, float], tokens: float, sequences: float) -> dict[str, float]:
    """The metrics (module docstring) from the summed :func:`diagnostic_sums` and the counts of trained
    tokens and sequences; empty over no token."""
    if tokens <= 0 or sequences <= 0:
        return {}
    return {"ess": totals["is_w"] ** 2 / (tokens * totals["is_w_sq"]), "kl": totals["is_kl"] / tokens,
            "k3_kl": totals["is_k3"] / tokens, "chi2_token": totals["is_rho_sq"] / tokens - 1.0,
            "ppl_ratio": totals["is_ppl_ratio"] / sequences,
            "log_ppl_abs_diff": totals["is_log_ppl_abs_diff"] / sequences,
            "chi2_seq": totals["is_rho_seq_sq"] / sequences - 1.0}
