"""Outcome advantages from per-sequence rewards and their prompt groups.

Every estimator takes ``rewards`` float [B] and ``group_ids`` int64 [B] (equal ids = same prompt;
:func:`group_index` turns the samples' string ``group_id`` into such a tensor) and returns float [B];
``reinforce_pp`` also takes ``token_counts`` [B], each sample's trained tokens (see
:data:`TOKEN_WEIGHTED`). Standard deviations are the unbiased (Bessel-corrected) ones.
``reinforce_plus_plus`` gives token advantages instead (:func:`reinforce_plus_plus`, :data:`TOKEN_LEVEL`).

Groups of one sample follow verl (``verl/trainer/ppo/core_algos.py``: ``compute_grpo_outcome_advantage``,
``compute_rloo_outcome_advantage``, ``compute_reinforce_plus_plus_baseline_outcome_advantage`` set a
single-sample group's mean to 0 and its std to 1): such a group has no baseline, so the sample keeps
its raw score: ``r`` (dr_grpo, rloo, the reinforce_pp baseline step) or ``r / (1 + eps)`` (grpo).
A group of several samples whose rewards are all equal gets advantage exactly 0 (verl: 0 / (0 + eps)).

:func:`assign_advantages` is what a step runs: the outcome estimator, then the per-turn (process) and
the teacher's (distillation) token advantages where the batch has them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np
import torch

from megarl.algos.distill import fill_distill_advantages
from megarl.algos.gae import CRITIC_ADVANTAGES
from megarl.algos.process import fill_process_advantages
from megarl.algos.registry import choose
from megarl.sample import RolloutSample

AdvantageFn = Callable[..., torch.Tensor]


def group_index(group_ids: Sequence[Hashable]) -> torch.Tensor:
    """Contiguous int64 [B] indices for any hashable group ids, in order of first appearance."""
    first_seen: dict[Hashable, int] = {}
    return torch.tensor([first_seen.setdefault(g, len(first_seen)) for g in group_ids], dtype=torch.int64)


def _check(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be [B]; got {tuple(rewards.shape)} and "
                         f"{tuple(group_ids.shape)}")
    if group_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype} (see group_index)")


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size n_g, baseline, unbiased group std): baseline = group mean and std as
    computed when n_g > 1; baseline 0 and std 1 when n_g = 1 (verl's convention, module docstring)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    n = counts.to(rewards.dtype)[inverse]
    mean = (sums / counts.to(rewards.dtype))[inverse]
    sq = torch.zeros_like(sums).index_add_(0, inverse, (rewards - mean) ** 2)[inverse]
    alone = n == 1
    std = torch.where(alone, torch.ones_like(sq), (sq / (n - 1).clamp(min=1)).sqrt())
    return n, torch.where(alone, torch.zeros_like(mean), mean), std


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the sample's group g; 0 where the group's
    rewards are all equal (std 0), ``r_i / (1 + eps)`` for a group of one."""
    _check(rewards, group_ids)
    _, mean, std = _group_stats(rewards, group_ids)
    return torch.where(std > 0, (rewards - mean) / (std + eps), torch.zeros_like(rewards))


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: ``A_i = r_i - mean_g(r)`` (no division by the group std); ``r_i`` for a group of one."""
    _check(rewards, group_ids)
    _, mean, _ = _group_stats(rewards, group_ids)
    return rewards - mean


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: ``A_i = r_i - (sum_g(r) - r_i) / (n_g - 1)``, the mean of the other samples of the group.

    Equivalently ``n_g / (n_g - 1) * (r_i - mean_g(r))``; ``r_i`` for a group of one.
    """
    _check(rewards, group_ids)
    n, mean, _ = _group_stats(rewards, group_ids)
    return torch.where(n > 1, n / (n - 1).clamp(min=1) * (rewards - mean), rewards)


def reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor, *, token_counts: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: ``a_i = r_i - mean_g(r)``, then whitened over the batch's trained tokens.

    As verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``),
    which broadcasts ``a_i`` to the sample's n_i trained tokens and applies ``verl_F.masked_whiten``
    (``verl/utils/torch_functional.py``): with ``N = sum_i n_i``, ``mu = sum_i n_i a_i / N``,
    ``var = sum_i n_i (a_i - mu)^2 / (N - 1)`` (Bessel over tokens), ``A_i = (a_i - mu) * rsqrt(var + 1e-8)``.
    (verl's masked_mean divides by ``N + 1e-8``; here by N.) ``token_counts`` float or int [B] = n_i,
    each sample's trained tokens (loss-mask sum); needs ``N >= 2``.
    """
    _check(rewards, group_ids)
    if token_counts.shape != rewards.shape:
        raise ValueError(f"token_counts must be [B] = {tuple(rewards.shape)}, got {tuple(token_counts.shape)}")
    _, mean, _ = _group_stats(rewards, group_ids)
    centred = rewards - mean
    n = token_counts.to(rewards.dtype)
    total = n.sum()
    if total < 2:
        raise ValueError(f"reinforce_pp whitens over the batch's trained tokens and needs at least 2, got {total}")
    mu = (n * centred).sum() / total
    var = (n * (centred - mu) ** 2).sum() / (total - 1)
    return (centred - mu) * torch.rsqrt(var + 1e-8)


def maxrl(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """MaxRL: ``A_i = (r_i - mean_g(r)) / (mean_g(r) + eps)``, the group-relative reward normalised by the group's
    mean reward, as SkyRL's ``compute_maxrl_advantage`` (``skyrl/backends/skyrl_train/utils/ppo_utils.py``,
    ``epsilon=1e-6``); a group of one keeps ``r_i`` (its mean is taken as 0 and nothing is divided)."""
    _check(rewards, group_ids)
    n, mean, _ = _group_stats(rewards, group_ids)
    return torch.where(n > 1, (rewards - mean) / (mean + eps), rewards)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """verl's REINFORCE++ returns of one row: from the end, ``G_t = r_t + gamma * G_{t+1}``, with ``G_{t+1}`` reset
    to 0 after every position of ``mask`` 0 (verl's "reset after EOS": ``running_return * response_mask[t]``).
    ``token_rewards`` and ``mask`` [R]; float64 [R]. Each run between resets is one reverse discounted sum
    (``scipy.signal.lfilter``), not a Python loop over the tokens."""
    from scipy.signal import lfilter

    rewards = np.asarray(token_rewards, dtype=np.float64)
    cuts = np.flatnonzero(np.asarray(mask)[1:] == 0) + 1  # G_{t-1} does not see G_t where mask[t] == 0
    runs = [lfilter([1.0], [1.0, -gamma], run[::-1])[::-1] for run in np.split(rewards, cuts)]
    return torch.from_numpy(np.concatenate(runs) if runs else rewards.copy())


def masked_whiten(rows: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """verl's ``masked_whiten`` over every masked position of all ``rows`` together: ``(x - mu) * rsqrt(var +
    1e-8)``, mu and the unbiased variance over those positions; 0 elsewhere. Needs at least 2 positions."""
    flat = torch.cat([r[m > 0] for r, m in zip(rows, masks)])
    if len(flat) < 2:
        raise ValueError(f"whitening over the batch's trained tokens needs at least 2, got {len(flat)}")
    scale = torch.rsqrt(flat.var(unbiased=True) + 1e-8)
    return [torch.where(m > 0, (r - flat.mean()) * scale, torch.zeros_like(r)) for r, m in zip(rows, masks)]


def reinforce_plus_plus(rewards: torch.Tensor, loss_masks: Sequence[torch.Tensor],
                        gamma: float) -> list[torch.Tensor]:
    """REINFORCE++ (no baseline): token-level discounted returns, whitened over the batch's trained tokens.

    verl's ``compute_reinforce_plus_plus_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``; SkyRL's is a
    port): sample i's reward ``r_i`` sits on its last trained token (verl's reward managers write the score at
    the last valid response token), :func:`discounted_returns` at ``gamma``, then :func:`masked_whiten` over
    every trained token of the batch. ``rewards`` float [B]; ``loss_masks``: each sample's [R_i] response
    mask; returns each sample's float64 [R_i] token advantages (0 on untrained tokens)."""
    if rewards.dim() != 1 or len(loss_masks) != len(rewards):
        raise ValueError(f"rewards must be [B] with one loss mask each; got {tuple(rewards.shape)} and "
                         f"{len(loss_masks)} masks")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    returns, masks = [], [torch.as_tensor(m).double() for m in loss_masks]
    for reward, mask in zip(rewards.tolist(), masks):
        token_rewards = torch.zeros(len(mask), dtype=torch.float64)
        if (mask > 0).any():
            token_rewards[int((mask > 0).nonzero()[-1])] = reward
        returns.append(discounted_returns(token_rewards, mask, gamma))
    return masked_whiten(returns, masks)


def opd(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """On-policy distillation alone: sequence advantage 0; the teacher's per-token advantages
    (:mod:`megarl.algos.distill`) are the whole signal."""
    _check(rewards, group_ids)
    return torch.zeros_like(rewards)


ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp,
                                      "opd": opd, "maxrl": maxrl}
TOKEN_WEIGHTED = frozenset({"reinforce_pp"})  # estimators that also take token_counts [B]
TOKEN_LEVEL = {"reinforce_plus_plus": reinforce_plus_plus}  # estimators that give token advantages (gamma)


def advantage_fn(name: str) -> AdvantageFn:
    """The estimator ``AlgorithmConfig.advantage`` names."""
    return choose(ADVANTAGES, name, "advantage")


@dataclass
class BatchStats:
    reward_mean: float
    response_len_mean: float
    mixed_group_frac: float  # groups whose rewards are not all equal (GRPO has signal only there)
    tokens: int  # generated tokens
    metrics: dict[str, float] = field(default_factory=dict)  # more of the step's row (e.g. distill/reverse_kl)


def fill_advantages(samples: list[RolloutSample], estimator: str,
                    penalties: Sequence[float] | None = None, gamma: float = 1.0) -> BatchStats:
    """Set each sample's advantage with the configured estimator over its prompt group, from its
    reward minus its penalty (e.g. the KL to the reference); the stats are of the rewards. Token-weighted
    estimators get each sample's trained tokens (``loss_mask`` sum) as ``token_counts``. A critic's estimator
    (gae) sets 0: its per-token advantages come with the critic's values, in the step
    (:func:`megarl.algos.gae.ragged_gae`). A token-level estimator (:data:`TOKEN_LEVEL`, discount ``gamma``)
    sets 0 and adds its token advantages to ``token_advantages``."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    groups = group_index([s.group_id for s in samples])
    scores = rewards if penalties is None else rewards - torch.tensor(list(penalties), dtype=torch.float64)
    if estimator in CRITIC_ADVANTAGES:
        advantages = torch.zeros_like(scores)
    elif estimator in TOKEN_LEVEL:
        advantages = torch.zeros_like(scores)
        per_token = TOKEN_LEVEL[estimator](scores, [torch.from_numpy(s.loss_mask) for s in samples], gamma)
        for sample, tokens in zip(samples, per_token):
            tokens = tokens.numpy().astype(np.float32)
            sample.token_advantages = tokens if sample.token_advantages is None else sample.token_advantages + tokens
    elif estimator in TOKEN_WEIGHTED:
        counts = torch.tensor([int(s.loss_mask.sum()) for s in samples], dtype=torch.float64)
        advantages = advantage_fn(estimator)(scores, groups, token_counts=counts)
    else:
        advantages = advantage_fn(estimator)(scores, groups)
    for sample, value in zip(samples, advantages.tolist()):
        sample.advantage = value
    group_min = torch.full((int(groups.max()) + 1,), float("inf"),
                           dtype=torch.float64).scatter_reduce(0, groups, rewards, "amin")
    group_max = torch.full_like(group_min, float("-inf")).scatter_reduce(0, groups, rewards, "amax")
    lengths = [len(s.response_ids) for s in samples]
    return BatchStats(reward_mean=float(rewards.mean()), response_len_mean=sum(lengths) / len(lengths),
                     mixed_group_frac=float((group_max > group_min).double().mean()), tokens=sum(lengths))


def assign_advantages(samples: list[RolloutSample], algorithm, penalties: Sequence[float] | None = None, *,
                      distill: bool = False) -> BatchStats:
    """Every advantage of one step's ``samples``, in place, and the step's reward stats.

    ``algorithm`` is the ``algorithm`` section of the config (``megarl.algos.settings.AlgorithmConfig``).
    In order: the sequence advantage of ``algorithm.advantage`` over each prompt group, from the
    reward minus ``penalties`` (:func:`fill_advantages`); the process advantages of groups with turn
    rewards (:func:`megarl.algos.process.fill_process_advantages`); with ``distill`` (a teacher
    scored the samples), the OPD token advantages at ``algorithm.opd_coef`` and ``opd_baseline``
    (:func:`megarl.algos.distill.fill_distill_advantages`). The last two add to ``token_advantages``;
    their metrics (``process/*``, ``distill/reverse_kl``) join ``BatchStats.metrics``."""
    stats = fill_advantages(samples, algorithm.advantage, penalties, algorithm.gamma)
    stats.metrics |= fill_process_advantages(samples).metrics()
    if distill:
        stats.metrics |= fill_distill_advantages(samples, algorithm.opd_coef, algorithm.opd_baseline)
    return stats
