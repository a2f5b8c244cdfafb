"""Reduce a per-token loss [B, T] under a float ``loss_mask`` [B, T] (m) to a (numerator, denominator) pair.

Each aggregation returns this batch's numerator (differentiable scalar) and its share of the denominator
(scalar, no gradient); the loss is ``numerator / denominator``. A batch split into micro-batches or DP ranks
sums both over the parts and divides once (megatron's ``calculate_per_token_loss``), which gives exactly
the loss of the whole batch. Rejected tokens are already 0 in m, so they leave every numerator; whether
they leave the denominator depends on the aggregation: the counts of ``token_mean``, ``seq_mean_token_mean``
and ``seq_mean_token_sum`` are taken from m, after rejection; :data:`FIXED_DENOMINATORS` are counted
before it (``seq_mean_token_sum_norm``'s constant B * C; ``prompt_mean``'s per-row weights, made from the
trained tokens before the step). The names are verl's ``loss_agg_mode`` (``verl/trainer/ppo/core_algos.py``,
``agg_loss``) with ``_`` for ``-``, and SkyRL's ``prompt_mean``.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch

from megarl.algos.registry import choose

AggregationFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _masked(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    if per_token.shape != loss_mask.shape or per_token.dim() != 2:
        raise ValueError(f"per-token loss and loss_mask must both be [B, T]; got {tuple(per_token.shape)} and "
                         f"{tuple(loss_mask.shape)}")
    return torch.where(loss_mask > 0, per_token * loss_mask, torch.zeros_like(per_token))


def _sequences(loss_mask: torch.Tensor) -> torch.Tensor:
    return (loss_mask.sum(dim=1) > 0).sum().to(loss_mask.dtype)


def token_mean(per_token: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_{b,t} m L / sum_{b,t} m``: every trained token weighs the same."""
    return _masked(per_token, loss_mask).sum(), loss_mask.sum().detach()


def seq_mean_token_mean(per_token: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_b (sum_t m L / sum_t m) / #{b: sum_t m > 0}``: every sequence with a trained token weighs the same."""
    lengths = loss_mask.sum(dim=1)
    per_seq = _masked(per_token, loss_mask).sum(dim=1) / lengths.clamp(min=1e-12)
    return per_seq.sum(), _sequences(loss_mask).detach()


def seq_mean_token_sum(per_token: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_{b,t} m L / #{b: sum_t m > 0}``: longer sequences weigh more."""
    return _masked(per_token, loss_mask).sum(), _sequences(loss_mask).detach()


def seq_mean_token_sum_norm(per_token: torch.Tensor, loss_mask: torch.Tensor,
                            scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO's constant normaliser: ``sum_{b,t} m L / (B * C)``, B = every row of the batch (trained or
    not, rejected or not), C = ``scale`` (``AlgorithmConfig.loss_scale_factor``, by default the response
    budget ``rollout.max_new_tokens``); None = T, the padded length of ``loss_mask``.

    verl's ``agg_loss`` mode ``seq-mean-token-sum-norm`` takes ``sum_{b,t} m L / C`` per micro-batch with
    C = ``loss_scale_factor`` or else ``loss_mask.shape[-1]`` (its responses are padded to the response
    length, so that is the budget), then averages the micro-batches (``1 / gradient_accumulation`` in
    ``verl/workers/actor/dp_actor.py``) and the DP ranks: for micro-batches of b sequences that is b times
    this value. Dividing by the global B instead keeps the loss independent of the micro-batch split.
    Neither the mask nor rejection changes the denominator.
    """
    numerator = _masked(per_token, loss_mask).sum()
    constant = loss_mask.shape[-1] if scale is None else scale
    if isinstance(constant, bool) or not isinstance(constant, (int, float)) or constant <= 0:
        raise ValueError(f"seq_mean_token_sum_norm needs a constant loss_scale_factor > 0, got {constant!r}")
    return numerator, torch.tensor(float(loss_mask.shape[0] * constant), dtype=loss_mask.dtype,
                                   device=loss_mask.device)


def prompt_mean_weights(group_ids: torch.Tensor, trained_tokens: torch.Tensor) -> torch.Tensor:
    """float64 [B] row weights of :func:`prompt_mean` for a batch of B samples: ``w_b = B / (G * n_g(b))``, G the
    batch's prompt groups (distinct ``group_ids``, int [B]) and ``n_g`` the trained tokens of b's group
    (``trained_tokens`` [B], each sample's; 0 for a group without any: its rows weigh nothing)."""
    if group_ids.dim() != 1 or trained_tokens.shape != group_ids.shape:
        raise ValueError(f"group_ids and trained_tokens must both be [B]; got {tuple(group_ids.shape)} and "
                         f"{tuple(trained_tokens.shape)}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1
    per_group = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, trained_tokens.double())[inverse]
    return torch.where(per_group > 0, len(group_ids) / (groups * per_group.clamp(min=1)), torch.zeros_like(per_group))


def prompt_mean(per_token: torch.Tensor, loss_mask: torch.Tensor,
                row_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SkyRL's ``prompt_mean`` (``apply_loss_reduction_to_advantages_minibatch``,
    ``skyrl/backends/skyrl_train/utils/ppo_utils.py``): the token mean within each prompt group, then the mean
    over the groups, ``(1 / G) sum_g sum_{b in g, t} m L / n_g``. Here ``sum_b w_b sum_t m L / (rows)`` with
    :func:`prompt_mean_weights` ``w`` [B] of this batch's rows, taken over the whole batch (the denominator,
    every row, adds up to the batch's B over micro-batches and ranks; B / G of ``w`` cancels it). As SkyRL, whose
    scaling precedes its off-policy mask, a group's token count is taken before rejection."""
    if row_weights is None or row_weights.shape != loss_mask.shape[:1]:
        raise ValueError("prompt_mean needs the rows' weights [B] (prompt_mean_weights over the batch's groups)")
    numerator = (_masked(per_token, loss_mask).sum(dim=1) * row_weights.to(per_token.dtype)).sum()
    return numerator, torch.tensor(float(loss_mask.shape[0]), dtype=loss_mask.dtype, device=loss_mask.device)


AGGREGATIONS: dict[str, AggregationFn] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
    "prompt_mean": prompt_mean,
}
FIXED_DENOMINATORS = frozenset({"seq_mean_token_sum_norm", "prompt_mean"})  # counted before rejection
ROW_WEIGHTED = frozenset({"prompt_mean"})  # aggregations that take the rows' weights


def aggregation_fn(name: str, scale: Optional[float] = None, row_weights: Optional[torch.Tensor] = None
                   ) -> AggregationFn:
    """The reduction ``AlgorithmConfig.loss_agg`` names; ``scale`` is seq_mean_token_sum_norm's constant,
    ``row_weights`` prompt_mean's (:func:`prompt_mean_weights`)."""
    fn = choose(AGGREGATIONS, name, "loss_agg")
    if fn is seq_mean_token_sum_norm:
        return partial(fn, scale=scale)
    return partial(fn, row_weights=row_weights) if fn is prompt_mean else fn
