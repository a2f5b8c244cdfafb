"""Outcome advantages from per-sequence rewards and their prompt groups.

Every estimator takes ``rewards`` float [B] and ``group_ids`` int64 [B] (equal ids = same prompt;
:func:`group_index` turns the samples' string ``group_id`` into such a tensor) and returns float [B].
Standard deviations are the unbiased (Bessel-corrected) ones; a group of one sample has no baseline
and gets advantage 0, and so does every sample of a group (or batch) whose rewards are all equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from megarl.algos.registry import choose
from megarl.sample import RolloutSample

AdvantageFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    """Per-sample (group size n_g, group mean, unbiased group std; std = 0 when n_g = 1)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    n = counts.to(rewards.dtype)[inverse]
    mean = (sums / counts.to(rewards.dtype))[inverse]
    sq = torch.zeros_like(sums).index_add_(0, inverse, (rewards - mean) ** 2)[inverse]
    std = torch.where(n > 1, sq / (n - 1).clamp(min=1), torch.zeros_like(sq)).sqrt()
    return n, mean, std


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the sample's group g."""
    _check(rewards, group_ids)
    _, mean, std = _group_stats(rewards, group_ids)
    return torch.where(std > 0, (rewards - mean) / (std + eps), torch.zeros_like(rewards))


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: ``A_i = r_i - mean_g(r)`` (no division by the group std)."""
    _check(rewards, group_ids)
    _, mean, _ = _group_stats(rewards, group_ids)
    return rewards - mean


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: ``A_i = r_i - (sum_g(r) - r_i) / (n_g - 1)``, the mean of the other samples of the group.

    Equivalently ``n_g / (n_g - 1) * (r_i - mean_g(r))``; 0 for a group of one.
    """
    _check(rewards, group_ids)
    n, mean, _ = _group_stats(rewards, group_ids)
    return torch.where(n > 1, n / (n - 1).clamp(min=1) * (rewards - mean), torch.zeros_like(rewards))


def reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with baseline: ``a_i = r_i - mean_g(r)``, then ``A_i = (a_i - mean(a)) / (std(a) + eps)``.

    The second step normalises over the whole batch (all B samples), not per group.
    """
    centred = dr_grpo(rewards, group_ids)
    if centred.numel() < 2:
        raise ValueError("reinforce_pp normalises over the batch and needs at least 2 samples")
    std = centred.std()
    return (centred - centred.mean()) / (std + eps) if std > 0 else torch.zeros_like(centred)


ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp}


def advantage_fn(name: str) -> AdvantageFn:
    """The estimator ``AlgorithmConfig.advantage`` names."""
    return choose(ADVANTAGES, name, "advantage")


@dataclass
class BatchStats:
    reward_mean: float
    response_len_mean: float
    mixed_group_frac: float  # groups whose rewards are not all equal (GRPO has signal only there)
    tokens: int  # generated tokens


def fill_advantages(samples: list[RolloutSample], estimator: str,
                    penalties: Sequence[float] | None = None) -> BatchStats:
    """Set each sample's advantage with the configured estimator over its prompt group, from its
    reward minus its penalty (e.g. the KL to the reference); the stats are of the rewards."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    groups = group_index([s.group_id for s in samples])
    scores = rewards if penalties is None else rewards - torch.tensor(list(penalties), dtype=torch.float64)
    for sample, value in zip(samples, advantage_fn(estimator)(scores, groups).tolist()):
        sample.advantage = value
    group_min = torch.full((int(groups.max()) + 1,), float("inf"),
                           dtype=torch.float64).scatter_reduce(0, groups, rewards, "amin")
    group_max = torch.full_like(group_min, float("-inf")).scatter_reduce(0, groups, rewards, "amax")
    lengths = [len(s.response_ids) for s in samples]
    return BatchStats(reward_mean=float(rewards.mean()), response_len_mean=sum(lengths) / len(lengths),
                     mixed_group_frac=float((group_max > group_min).double().mean()), tokens=sum(lengths))
