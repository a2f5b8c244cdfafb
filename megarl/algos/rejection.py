"""Rejection of tokens or sequences by a divergence criterion between the trainer and the rollout engine.

The criteria and their names are verl's rejection sampling (``verl/trainer/ppo/rollout_corr_helper.py``,
``compute_rollout_rejection_mask``, config ``rollout_rs`` / ``rollout_rs_threshold``). With the log-ratio
``l_t = logp_train_t - logp_rollout_t`` [B, T] (clamped to +-20 first) and float ``loss_mask`` m [B, T]:

    k1_t = -l_t        k2_t = l_t^2 / 2        k3_t = exp(l_t) - 1 - l_t

(each an estimate of KL(rollout || train) on the rollout's own tokens). A criterion ``token_kN`` tests
every token, ``seq_sum_kN`` the sequence's ``sum_t m_t kN_t``, ``seq_mean_kN`` its mean over trained
tokens, ``seq_max_kN`` (k2, k3) its maximum over trained tokens; a sequence criterion keeps or rejects
the whole sequence. The k1 criteria keep ``log(lower) <= stat <= log(upper)`` (bounds on the ratio
rollout/train; verl's ``lower_upper`` threshold, the lower defaulting to ``1 / upper``); the k2 and k3
criteria keep ``stat <= upper``. Several criteria chain (``"token_k1,seq_max_k3"``): a token stays only
if every criterion keeps it. Rejected tokens leave the loss mask (:mod:`megarl.algos.off_policy`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

SAFETY_BOUND = 20.0
CRITERIA = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
            "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class Criterion:
    """One rejection criterion: its verl name, and its bounds on the statistic (k1: on the log of the
    ratio, both set; k2, k3: ``lower`` None)."""

    name: str
    upper: float
    lower: Optional[float] = None


def _k1_bounds(name: str, spec: str) -> Criterion:
    lower_text, upper_text = spec.split("_", 1) if "_" in spec else (None, spec)
    try:
        if "_" in upper_text:
            raise ValueError
        upper = float(upper_text)
        lower = 1.0 / upper if lower_text is None else float(lower_text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"threshold {spec!r} of {name} must be 'lower_upper' or one upper bound, both > 0") from None
    if lower <= 0 or upper <= 0 or lower > upper:
        raise ValueError(f"threshold {spec!r} of {name} needs 0 < lower <= upper")
    return Criterion(name, math.log(upper), math.log(lower))


def _upper_bound(name: str, spec: str) -> Criterion:
    try:
        if "_" in spec:  # float() reads "0.5_2" as 0.52
            raise ValueError
        upper = float(spec)
    except ValueError:
        raise ValueError(f"threshold {spec!r} of {name} must be one number (an upper bound)") from None
    if upper <= 0:
        raise ValueError(f"threshold {spec!r} of {name} must be > 0")
    return Criterion(name, upper)


def parse_criteria(names: str, thresholds: str | float | None) -> tuple[Criterion, ...]:
    """The criteria of ``names`` (comma-separated, each once, in order) with ``thresholds``: one spec for
    all or one per criterion, comma-separated, as verl's ``_parse_rollout_rs_thresholds``. Raises
    ValueError for an unknown name or a threshold that does not fit its criterion."""
    options = list(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
    unknown = [n for n in options if n not in CRITERIA]
    if not options or unknown:
        raise ValueError(f"unknown rejection criterion {', '.join(unknown) or repr(names)}; "
                         f"valid: {', '.join(CRITERIA)}")
    if thresholds is None:
        raise ValueError(f"rejection criteria {', '.join(options)} need a threshold")
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"{len(specs)} thresholds for {len(options)} rejection criteria: give one, or one each")
    return tuple(_k1_bounds(n, s) if n.endswith("k1") else _upper_bound(n, s) for n, s in zip(options, specs))


def _statistic(name: str, log_ratio: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """The criterion's statistic, [B, T] (token) or [B, 1] (sequence)."""
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    estimate = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.expm1(lr) - lr}[name[-2:]]
    if name.startswith("token_"):
        return estimate
    zero = torch.zeros_like(estimate)
    if name.startswith("seq_max_"):
        top = torch.where(trained, estimate, torch.full_like(estimate, -math.inf)).amax(dim=1, keepdim=True)
        return torch.where(trained.any(dim=1, keepdim=True), top, zero[:, :1])
    total = torch.where(trained, estimate, zero).sum(dim=1, keepdim=True)
    return total / trained.sum(dim=1, keepdim=True).clamp(min=1) if name.startswith("seq_mean_") else total


def rejection_keep(log_ratio: torch.Tensor, loss_mask: torch.Tensor,
                   criteria: Sequence[Criterion]) -> torch.Tensor:
    """bool [B, T]: the trained tokens (``loss_mask > 0``) every criterion keeps (module docstring).
    ``log_ratio`` [B, T] is ``logp_train - logp_rollout``, detached here."""
    if log_ratio.dim() != 2 or loss_mask.shape != log_ratio.shape:
        raise ValueError(f"log_ratio and loss_mask must both be [B, T]; got {tuple(log_ratio.shape)} and "
                         f"{tuple(loss_mask.shape)}")
    trained = loss_mask > 0
    keep = trained.clone()
    for c in criteria:
        stat = _statistic(c.name, log_ratio.detach(), trained)
        passed = stat <= c.upper if c.lower is None else (stat >= c.lower) & (stat <= c.upper)
        keep &= passed.expand_as(keep)
    return keep


def rejection_config_error(criteria: str | None, thresholds: str | None) -> tuple[str, str] | None:
    """(``algorithm.*`` key, why) when ``off_policy_rejection`` / ``off_policy_rejection_threshold`` do not
    parse, else None."""
    if criteria is None:
        return None if thresholds is None else (
            "algorithm.off_policy_rejection_threshold", "sets the bounds of off_policy_rejection: set it too")
    names = [n.strip() for n in criteria.split(",") if n.strip()]
    unknown = [n for n in names if n not in CRITERIA]
    if not names or unknown:
        return ("algorithm.off_policy_rejection", f"{', '.join(map(repr, unknown)) or 'nothing'} is not one of "
                f"{', '.join(CRITERIA)} (comma-separated, all must pass)")
    try:
        parse_criteria(criteria, thresholds)
    except ValueError as exc:
        return "algorithm.off_policy_rejection_threshold", str(exc)
    return None
