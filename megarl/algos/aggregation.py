"""Reduce a per-token loss [B, T] to a scalar under a float ``loss_mask`` [B, T] (m).

``denominator`` is the global normaliser when one batch is split into micro-batches or DP ranks
whose losses are summed: the total ``sum(m)`` for token_mean, the total number of sequences with
at least one trained token for the sequence means. None = this batch's own.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megarl.algos.registry import choose

AggregationFn = Callable[[torch.Tensor, torch.Tensor, Optional[float]], torch.Tensor]


def _masked(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    if per_token.shape != loss_mask.shape or per_token.dim() != 2:
        raise ValueError(f"per-token loss and loss_mask must both be [B, T]; got {tuple(per_token.shape)} and "
                         f"{tuple(loss_mask.shape)}")
    return torch.where(loss_mask > 0, per_token * loss_mask, torch.zeros_like(per_token))


def _divide(total: torch.Tensor, own: torch.Tensor, denominator: Optional[float]) -> torch.Tensor:
    if denominator is not None and denominator <= 0:
        raise ValueError(f"denominator must be > 0, got {denominator}")
    return total / (denominator if denominator is not None else own.clamp(min=1))


def token_mean(per_token: torch.Tensor, loss_mask: torch.Tensor, denominator: Optional[float] = None) -> torch.Tensor:
    """``sum_{b,t} m L / sum_{b,t} m``: every trained token weighs the same."""
    return _divide(_masked(per_token, loss_mask).sum(), loss_mask.sum(), denominator)


def seq_mean_token_mean(per_token: torch.Tensor, loss_mask: torch.Tensor,
                        denominator: Optional[float] = None) -> torch.Tensor:
    """``mean_b (sum_t m L / sum_t m)`` over sequences with ``sum_t m > 0``: every sequence weighs the same."""
    lengths = loss_mask.sum(dim=1)
    per_seq = _masked(per_token, loss_mask).sum(dim=1) / lengths.clamp(min=1e-12)
    return _divide(per_seq.sum(), (lengths > 0).sum(), denominator)


def seq_mean_token_sum(per_token: torch.Tensor, loss_mask: torch.Tensor,
                       denominator: Optional[float] = None) -> torch.Tensor:
    """``mean_b sum_t m L`` over sequences with ``sum_t m > 0``: longer sequences weigh more (Dr.GRPO-style)."""
    lengths = loss_mask.sum(dim=1)
    return _divide(_masked(per_token, loss_mask).sum(), (lengths > 0).sum(), denominator)


AGGREGATIONS: dict[str, AggregationFn] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
}


def aggregation_fn(name: str) -> AggregationFn:
    """The reduction ``AlgorithmConfig.loss_agg`` names."""
    return choose(AGGREGATIONS, name, "loss_agg")


def denominator_share(name: str, loss_mask: torch.Tensor) -> torch.Tensor:
    """This batch's part of the global ``denominator`` of aggregation ``name``: its trained tokens
    (token_mean) or its sequences with at least one trained token (the sequence means)."""
    aggregation_fn(name)  # validates the name
    if name == "token_mean":
        return loss_mask.sum()
    return (loss_mask.sum(dim=1) > 0).sum().to(loss_mask.dtype)
