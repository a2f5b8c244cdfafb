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

``algorithm.advantage=gae`` needs the critic that gives ``values`` (``critic.enabled``, :mod:`megarl.trainer.critic`).
A step's batch is ragged (samples back to back): :func:`ragged_gae` puts each sample's reward on its last
trained token (verl's convention: its reward managers, ``verl/workers/reward_manager/naive.py``, write the
score at ``valid_response_length - 1``, a token-level reward that is 0 elsewhere) and runs :func:`gae` on
the rows.
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


def _rows(flat: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged [N] -> zero-padded rows [B, T], and the flat index of every ragged position in them."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    width = max(int(lengths.max()), 1) if len(lengths) else 1
    row = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    index = row * width + torch.arange(len(flat)) - cu_seqlens[:-1][row]
    grid = flat.new_zeros(len(lengths) * width)
    grid[index] = flat
    return grid.view(len(lengths), width), index


def ragged_gae(rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
               gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(whitened advantages, returns), float32 [N], of a ragged batch: ``rewards`` float [B] (each sample's
    sequence reward, placed on its last trained token), ``values`` and ``loss_mask`` float [N] and
    ``cu_seqlens`` int64 [B + 1] as :class:`megarl.trainer.rl_batch.RLBatch` holds them; :func:`gae` on the rows.
    A sample without a trained token (e.g. every token of it mixed two weight versions) trains nothing: its
    reward is placed nowhere and its advantages and returns are 0."""
    if rewards.dim() != 1 or len(cu_seqlens) != len(rewards) + 1 or values.shape != loss_mask.shape:
        raise ValueError(f"need rewards [B], cu_seqlens [B + 1] and values, loss_mask [N]; got {tuple(rewards.shape)}, "
                         f"{tuple(cu_seqlens.shape)}, {tuple(values.shape)}, {tuple(loss_mask.shape)}")
    values64, mask = _rows(values.double(), cu_seqlens)[0], _rows(loss_mask.double(), cu_seqlens)[0]
    trained = mask > 0
    rewarded = trained.any(1).nonzero().flatten()
    last = mask.shape[1] - 1 - trained.flip(1).int().argmax(1)
    token_rewards = torch.zeros_like(values64)
    token_rewards[rewarded, last[rewarded]] = rewards.double()[rewarded]
    advantages, returns = gae(token_rewards, values64, mask, gamma, lam)
    index = _rows(values, cu_seqlens)[1]
    return advantages.flatten()[index].float(), returns.flatten()[index].float()
