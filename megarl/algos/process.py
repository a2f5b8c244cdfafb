"""Per-turn (process) rewards -> per-token advantages, after verl's PRIME recipe
(``recipe/prime/prime_core_algos.py``, ``compute_rloo_advantage_return``).

PRIME puts each reward at a token, gives each reward source an RLOO baseline over the prompt group
(``masked_rloo``) and sums the result from the end of the response (gamma 1, the return-to-go).
For a group of n samples, sample i with rewards ``r_{i,k}`` at its marked positions:

    m_j     = mean of sample j's rewards                       (``cur_rewards_mean``)
    a_{i,k} = n / (n - 1) * r_{i,k} - (sum_j m_j) / (n - 1)     (``masked_rloo``), 0 at unmarked tokens
    A_{i,t} = sum_{s >= t} a_{i,s}                              (``returns``: flip, cumsum, flip)

Here the marked positions are turn ends: ``turn_rewards[k]`` sits at the turn's last token, response
offset ``turn_ends[k] - 1`` (as PRIME marks its outcome reward ``acc`` at the last response token).
``A`` at policy tokens becomes the sample's ``token_advantages`` (added to those already there),
environment tokens (loss mask 0) get 0; the loss adds the sample's outcome advantage
(``RLBatch.position_advantages``). With ``algorithm.advantage=rloo`` the sum is PRIME's ``returns``
with the outcome reward as ``acc`` (gt_coef 1) and the turn rewards as a second source: an RLOO
reward at the last token, summed from the end, is the sample's RLOO advantage at every token.

Departures from PRIME: groups are the samples' ``group_id`` (any order; PRIME takes blocks of n);
a group of one has no baseline and keeps its raw rewards (megarl's rloo; PRIME divides by n - 1 = 0);
PRIME's final ``masked_whiten`` over the batch is not applied (the outcome part is normalised by
the configured estimator already).
"""
from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megarl.sample import RolloutSample


@dataclass(frozen=True)
class ProcessStats:
    samples: int  # samples given process advantages
    turns: int  # their turns
    turn_reward_mean: float  # mean turn reward (nan without turns)

    def metrics(self) -> dict[str, float]:
        """``process/turn_reward_mean`` and ``process/turns`` for the step's row; empty without turn rewards."""
        return {"process/turn_reward_mean": self.turn_reward_mean, "process/turns": self.turns} if self.turns else {}


def _check(sample: RolloutSample, where: str) -> None:
    ends, rewards = sample.turn_ends, sample.turn_rewards
    if len(rewards) != len(ends):
        raise ValueError(f"{where}: {len(rewards)} turn_rewards for {len(ends)} turn_ends")
    r = len(sample.response_ids)
    if any(b <= a for a, b in zip((0, *ends), ends)) or any(e > r for e in ends):
        raise ValueError(f"{where}: turn_ends {ends} must increase within the response of {r} tokens")
    if not all(math.isfinite(x) for x in rewards):
        raise ValueError(f"{where}: turn_rewards {rewards} must be finite")
    at_env = [e for e in ends if not sample.loss_mask[e - 1]]
    if at_env:
        raise ValueError(f"{where}: turns end at environment tokens (loss mask 0) at offsets {at_env}; a turn's "
                         "last token is the policy's")


def process_advantages(samples: Sequence[RolloutSample]) -> list[np.ndarray | None]:
    """Per sample, float32 [R] process advantages (module docstring), or None for a sample whose
    group has no turn rewards. Raises ValueError for a group where only some samples have turn
    rewards, and for turn rewards that do not fit the sample (count, turn ends, non-finite values,
    a turn ending at an environment token)."""
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for i, s in enumerate(samples):
        groups[s.group_id].append(i)
    out: list[np.ndarray | None] = [None] * len(samples)
    for group_id, members in groups.items():
        rewarded = [i for i in members if samples[i].turn_rewards]
        if not rewarded:
            continue
        if len(rewarded) != len(members):
            raise ValueError(f"group {group_id!r}: {len(rewarded)} of {len(members)} samples have turn_rewards; a "
                             "group's baseline needs all of them")
        for i in members:
            _check(samples[i], f"sample {i} (group {group_id!r})")
        n = len(members)
        total = sum(float(np.mean(samples[i].turn_rewards)) for i in members)
        for i in members:
            s = samples[i]
            rewards = np.asarray(s.turn_rewards, dtype=np.float64)
            marked = rewards if n == 1 else n / (n - 1) * rewards - total / (n - 1)
            token = np.zeros(len(s.response_ids), dtype=np.float64)
            token[np.asarray(s.turn_ends) - 1] = marked
            returns = np.cumsum(token[::-1])[::-1]
            out[i] = np.where(s.loss_mask.astype(bool), returns, 0.0).astype(np.float32)
    return out


def fill_process_advantages(samples: Sequence[RolloutSample]) -> ProcessStats:
    """Add :func:`process_advantages` to each sample's ``token_advantages`` (set where None); once
    per batch, after the outcome estimator. Samples of groups without turn rewards are left as they are."""
    rewards: list[float] = []
    count = 0
    for sample, advantages in zip(samples, process_advantages(samples)):
        if advantages is None:
            continue
        count += 1
        rewards += sample.turn_rewards
        sample.token_advantages = advantages if sample.token_advantages is None else (
            sample.token_advantages + advantages)
    return ProcessStats(samples=count, turns=len(rewards),
                        turn_reward_mean=float(np.mean(rewards)) if rewards else math.nan)
