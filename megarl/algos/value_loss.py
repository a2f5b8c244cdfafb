"""The critic's clipped value loss (PPO's value-function clipping).

For the critic's new predictions ``v`` [B, T], the values it gave when the batch was collected
``v_old`` [B, T] and the GAE returns ``R`` [B, T] (:mod:`megarl.algos.gae`), per token::

    v_clip = clamp(v, v_old - c, v_old + c)
    L_t    = 0.5 * max((v - R)^2, (v_clip - R)^2)

with ``c`` the clip range; clipped where the clipped term is the larger. This is verl's
``compute_value_loss`` (``verl/trainer/ppo/core_algos.py``, after TRL's PPO trainer): its loss is
``0.5 * agg_loss(max(...))``, which is the aggregation of ``L`` here (:mod:`megarl.algos.aggregation`),
and its ``vf_clipfrac`` the mean of ``clipped`` over the mask.

:func:`value_metrics` says how well the critic's values fit the returns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ValueLoss:
    per_token: torch.Tensor  # float [B, T], 0 where loss_mask == 0; the gradient flows through the new values
    clipped: torch.Tensor  # bool [B, T]: the clipped term was the larger (trained tokens only)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       loss_mask: torch.Tensor, clip: float) -> ValueLoss:
    """PPO's clipped value loss per token (module docstring); all inputs [B, T], ``clip`` > 0."""
    if values.dim() != 2 or not values.shape == old_values.shape == returns.shape == loss_mask.shape:
        raise ValueError(f"values, old_values, returns and loss_mask must all be [B, T]; got {tuple(values.shape)}, "
                         f"{tuple(old_values.shape)}, {tuple(returns.shape)}, {tuple(loss_mask.shape)}")
    if clip <= 0:
        raise ValueError(f"the value clip range must be > 0, got {clip}")
    old, target = old_values.detach(), returns.detach()
    plain = (values - target) ** 2
    bounded = (torch.maximum(torch.minimum(values, old + clip), old - clip) - target) ** 2
    trained = loss_mask > 0
    per_token = 0.5 * torch.maximum(plain, bounded)
    return ValueLoss(torch.where(trained, per_token, torch.zeros_like(per_token)), (bounded > plain) & trained)


def value_metrics(values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
    """Over the trained tokens (``loss_mask > 0``; all three tensors of one shape): ``critic/explained_variance``
    ``1 - Var(R - v) / Var(R)`` (verl's ``critic/vf_explained_var``, ``verl/trainer/ppo/metric_utils.py``,
    unbiased variances and its 1e-5 in the denominator), ``critic/value_error`` ``mean((v - R)^2)`` and
    ``critic/values_mean``. Needs at least two trained tokens."""
    trained = loss_mask > 0
    if int(trained.sum()) < 2:
        raise ValueError(f"value metrics need at least 2 trained tokens, got {int(trained.sum())}")
    v, r = values[trained].double(), returns[trained].double()
    explained = 1.0 - (r - v).var() / (r.var() + 1e-5)
    return {"critic/explained_variance": float(explained), "critic/value_error": float(((v - r) ** 2).mean()),
            "critic/values_mean": float(v.mean())}
