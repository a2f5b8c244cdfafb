"""Per-token estimators of KL(pi || pi_ref) from log-probs of the sampled tokens.

Inputs are float [B, T] (finite); ``x = logp - logp_ref`` is the log-ratio. Outputs are [B, T]
with the gradient flowing through ``logp``; reduce with :mod:`megarl.algos.aggregation`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megarl.algos.registry import choose


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = x`` (unbiased, can be negative)."""
    return logprobs - ref_logprobs


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = x^2 / 2``."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(-x) + x - 1 = pi_ref/pi - log(pi_ref/pi) - 1`` (unbiased, >= 0)."""
    x = logprobs - ref_logprobs
    return torch.exp(-x) + x - 1.0


def k3_is(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``(pi / pi_old) * k3``: k3 re-weighted to the current policy when tokens came from ``pi_old``.

    The ratio ``exp(logp - logp_old)`` keeps its gradient, which makes the gradient unbiased too.
    """
    return torch.exp(logprobs - old_logprobs.detach()) * k3(logprobs, ref_logprobs)


KL_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {"k1": k1, "k2": k2, "k3": k3, "k3_is": k3_is}


def kl_penalty(
    name: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The estimator ``AlgorithmConfig.kl_type`` names, [B, T]; ``k3_is`` needs ``old_logprobs``."""
    estimator = choose(KL_ESTIMATORS, name, "kl_type")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
                         "differ in shape")
    if estimator is k3_is:
        if old_logprobs is None or old_logprobs.shape != logprobs.shape:
            raise ValueError("kl_type k3_is needs old_logprobs of the same shape as logprobs")
        return k3_is(logprobs, ref_logprobs, old_logprobs)
    return estimator(logprobs, ref_logprobs)
