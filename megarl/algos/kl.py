"""Per-token estimators of KL(pi || pi_ref) from log-probs of the sampled tokens (Schulman's k1, k2, k3).

Inputs are float [B, T] (finite); ``x = logp - logp_ref`` is the log-ratio. Outputs are [B, T]
with the gradient flowing through ``logp``; reduce with :mod:`megarl.algos.aggregation`.
The ``*_is`` estimators take ``old_logprobs`` too (see :func:`importance_weighted`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megarl.algos.registry import choose


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = x`` (unbiased, can be negative)."""
    return logprobs - ref_logprobs


def absolute(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``abs = |x|``, verl's ``kl_penalty_forward`` name ``abs`` (``verl/trainer/ppo/core_algos.py``) and SkyRL's
    ``compute_approx_kl`` ``kl_estimator_type="abs"`` (``skyrl/backends/skyrl_train/utils/ppo_utils.py``): biased,
    >= 0, its gradient ``sign(x)`` (0 at x = 0, torch's)."""
    return (logprobs - ref_logprobs).abs()


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = x^2 / 2``."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(-x) + x - 1 = pi_ref/pi - log(pi_ref/pi) - 1`` (unbiased, >= 0), unclamped as slime's
    ``k3`` (``slime/utils/ppo_utils.py``, ``compute_approx_kl``); verl's ``k3`` is :func:`low_var_kl`."""
    x = logprobs - ref_logprobs
    return torch.exp(-x) + x - 1.0


def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 with verl's clamps (``verl/trainer/ppo/core_algos.py``, ``kl_penalty_forward``, names ``low_var_kl``
    and ``k3``): ``clamp(exp(-x') + x' - 1, -10, 10)`` with ``x' = clamp(x, -20, 20)``. slime's ``low_var_kl``
    clamps only the result, which has the same value (outside |x| <= 20 the result is past 10 either way).
    """
    x = (logprobs - ref_logprobs).clamp(-20.0, 20.0)
    return (torch.exp(-x) + x - 1.0).clamp(-10.0, 10.0)


SAFETY_BOUND = 20.0  # |log-ratio| clamp before exp (verl's low_var_kl; exp(20) ~ 4.9e8)


def importance_weighted(estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], logprobs: torch.Tensor,
                        ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``(pi / pi_old) * k``: the estimator re-weighted to the current policy when tokens came from ``pi_old``
    (slime's ``use_unbiased_kl``: ``importance_ratio * kl`` in ``compute_approx_kl``, the DeepSeek-V3.2 form).

    The ratio ``exp(clamp(logp - sg(logp_old), -20, 20))`` keeps its gradient, which makes the gradient
    unbiased too; the clamp only guards exp against overflow.
    """
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.exp(log_ratio) * estimator(logprobs, ref_logprobs)


def k1_is(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``(pi / pi_old) * k1``."""
    return importance_weighted(k1, logprobs, ref_logprobs, old_logprobs)


def k2_is(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``(pi / pi_old) * k2``."""
    return importance_weighted(k2, logprobs, ref_logprobs, old_logprobs)


def k3_is(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``(pi / pi_old) * k3``, unclamped (slime's ``k3`` with ``use_unbiased_kl``)."""
    return importance_weighted(k3, logprobs, ref_logprobs, old_logprobs)


def _k3_bounded_below(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 with ``x >= -50``: exp(-x) cannot overflow (an infinite k3 would make the clamp's zero gradient
    NaN); with the weight >= exp(-20), ``w * k3`` is past 10 for every ``x < -50``, so the clamped value
    is unchanged."""
    x = (logprobs - ref_logprobs).clamp(min=-50.0)
    return torch.exp(-x) + x - 1.0


def low_var_kl_is(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``clamp((pi / pi_old) * k3, -10, 10)``: :func:`k3_is` clamped after the weight, as slime's
    ``compute_approx_kl`` does for ``low_var_kl`` (``slime/utils/ppo_utils.py``: ``kl = importance_ratio * kl``,
    then ``torch.clamp(kl, min=-10, max=10)``). verl's ``low_var_kl`` clamps before any weight (:func:`low_var_kl`)."""
    return importance_weighted(_k3_bounded_below, logprobs, ref_logprobs, old_logprobs).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "k1": k1, "k2": k2, "k3": k3, "low_var_kl": low_var_kl, "k1_is": k1_is, "k2_is": k2_is, "k3_is": k3_is,
    "low_var_kl_is": low_var_kl_is, "abs": absolute,
}
IMPORTANCE_WEIGHTED = frozenset({"k1_is", "k2_is", "k3_is", "low_var_kl_is"})  # estimators that also take old_logprobs


def kl_penalty(
    name: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The estimator ``AlgorithmConfig.kl_type`` names, [B, T]; the ``*_is`` ones need ``old_logprobs``."""
    estimator = choose(KL_ESTIMATORS, name, "kl_type")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
                         "differ in shape")
    if name in IMPORTANCE_WEIGHTED:
        if old_logprobs is None or old_logprobs.shape != logprobs.shape:
            raise ValueError(f"kl_type {name} needs old_logprobs of the same shape as logprobs")
        return estimator(logprobs, ref_logprobs, old_logprobs)
    return estimator(logprobs, ref_logprobs)
