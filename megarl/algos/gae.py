"""Generalized Advantage Estimation (GAE) from per-token rewards and a critic's per-token values.

For a [B, T] batch with float ``loss_mask`` m (1 = a token the policy generated), per row, over its
trained tokens only (an environment's tokens, m = 0, are skipped: their reward and value take no part,
and the recursion runs from the next trained token to the previous one as if they were absent)::

    delta_t = r_t + gamma * V_next - V_t             (V_next: the value of the next trained token, 0 after the last)
    A_t     = delta_t + gamma * lam * A_next
    R_t     = A_t + V_t                              (the critic's target)

then ``A`` is whitened over the batch's trained tokens, ``(A - mean) / sqrt(var + 1e-8)`` with the unbiased
variance. This is verl's ``compute_gae_advantage_return`` (``verl/trainer/ppo/core_algos.py``, after TRL's
PPO trainer, with its ``masked_whiten``); verl's rows hold the response only, as ``loss_mask`` rows do here.
Untrained positions get 0 in both outputs.

``algorithm.advantage=gae`` needs the critic that gives ``values``; it is refused at load until one exists.
"""
from __future__ import annotations

import torch

CRITIC_ADVANTAGES = frozenset({"gae"})  # advantage estimators that need a critic's per-token values


def gae(token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(whitened advantages, returns), both float [B, T] like ``values`` (module docstring); no gradient.
    ``token_rewards``, ``values`` and ``loss_mask`` are [B, T]; needs at least two trained tokens."""
    if values.dim() != 2 or token_rewards.shape != values.shape or loss_mask.shape != values.shape:
        raise ValueError(f"token_rewards, values and loss_mask must all be [B, T]; got {tuple(token_rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(loss_mask.shape)}")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    trained = loss_mask > 0
    count = int(trained.sum())
    if count < 2:
        raise ValueError(f"GAE whitens over the batch's trained tokens and needs at least 2, got {count}")
    with torch.no_grad():
        advantages = torch.zeros_like(values)
        following = values.new_zeros(values.shape[0])  # A of the next trained token
        next_value = values.new_zeros(values.shape[0])
        for t in range(values.shape[1] - 1, -1, -1):
            here = trained[:, t]
            delta = token_rewards[:, t] + gamma * next_value - values[:, t]
            following = torch.where(here, delta + gamma * lam * following, following)
            next_value = torch.where(here, values[:, t], next_value)
            advantages[:, t] = following
        returns = torch.where(trained, advantages + values, torch.zeros_like(values))
        picked = advantages[trained]
        whitened = (advantages - picked.mean()) * torch.rsqrt(picked.var(unbiased=True) + 1e-8)
        return torch.where(trained, whitened, torch.zeros_like(values)), returns
