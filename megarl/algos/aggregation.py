"""Reduce a per-token loss [B, T] under a float ``loss_mask`` [B, T] (m) to a (numerator, denominator) pair.

Each aggregation returns this batch's numerator (differentiable scalar) and its share of the
denominator (scalar, no gradient); the loss is ``numerator / denominator``. A batch split into
micro-batches or DP ranks sums both over the parts and divides once (megatron's
``calculate_per_token_loss``), which gives exactly the loss of the whole batch. Rejected tokens are
already 0 in m, so they leave both (``megarl.algos.objective``). The names are verl's ``loss_agg_mode``
(``verl/trainer/ppo/core_algos.py``, ``agg_loss``) with ``_`` for ``-``.
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


AGGREGATIONS: dict[str, AggregationFn] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}


def aggregation_fn(name: str, scale: Optional[float] = None) -> AggregationFn:
    """The reduction ``AlgorithmConfig.loss_agg`` names; ``scale`` is seq_mean_token_sum_norm's constant."""
    fn = choose(AGGREGATIONS, name, "loss_agg")
    return partial(fn, scale=scale) if fn is seq_mean_token_sum_norm else fn
