"""Train-inference mismatch apart from staleness drift.

A trained token is *current* when the weights that generated it are the ones the trainer holds
(staleness 0): |trainer - rollout| log-prob then measures how much the two implementations disagree
(``mismatch/current_logprob_abs_diff``, its mean, and ``..._max``). On a *stale* token (staleness > 0)
the same difference mostly measures how far the policy moved since, so it is reported apart, as drift.
Current tokens are of two kinds, also reported apart: *fresh* ones, in a sample with no older token,
and *boundary* ones, in a sample continued across a weight update (a partial rollout). The engine
computed a boundary token over a prefix it recomputed with the prefix tokens' own routes (those the
trainer replays: docs/architecture.md, "Partial rollouts"), so the trainer reproduces both kinds
alike; the split shows it.

:func:`mismatch_sums` gives one micro-batch's sums and maxima, :func:`reduce_mismatch` combines
them over micro-batches and data-parallel ranks, :func:`mismatch_metrics` turns the totals into
the logged metrics.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

SUMMED = ("fresh_tokens", "fresh_abs_diff", "fresh_kl", "stale_tokens", "stale_abs_diff", "boundary_tokens",
          "boundary_abs_diff", "outside_mask")
MAXED = ("fresh_ratio_dev_max", "stale_ratio_dev_max", "current_abs_diff_max")


def mismatch_sums(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                  staleness: torch.Tensor, outside_mask: torch.Tensor, cu_seqlens: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """Detached float64 scalars over the trained tokens (``loss_mask > 0``) of flat [N] tensors:
    ``trainer_logprobs``/``rollout_logprobs`` float, ``loss_mask`` float, ``staleness`` int, the samples'
    ``cu_seqlens`` int64 [B + 1], plus ``outside_mask`` (int scalar, :attr:`TokenLogprobs.outside_mask`)
    passed through.

    Keys in :data:`SUMMED` add up over micro-batches and ranks: ``fresh_tokens``, ``fresh_abs_diff``
    (sum |trainer - rollout|), ``fresh_kl`` (sum of k3 = exp(-x) - 1 + x with
    x = rollout - trainer: Schulman's k3 estimate of KL(rollout || trainer) on tokens the rollout
    policy sampled) over staleness 0; ``stale_tokens``, ``stale_abs_diff`` over
    staleness > 0; ``boundary_tokens``, ``boundary_abs_diff`` over staleness 0 in a sample with a trained
    token of staleness > 0 (not counted as fresh); ``outside_mask``. Keys in :data:`MAXED` take the maximum:
    ``fresh_ratio_dev_max``, ``stale_ratio_dev_max`` (max |exp(trainer - rollout) - 1|, 0 over no tokens),
    ``current_abs_diff_max`` (max |trainer - rollout| over fresh and boundary tokens, 0 over none).
    """
    x = rollout_logprobs.detach().double() - trainer_logprobs.detach().double()
    trained = loss_mask > 0
    stale = trained & (staleness > 0)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths, output_size=len(x))
    has_stale = torch.zeros(len(lengths), dtype=torch.long, device=x.device).index_add_(0, sample, stale.long()) > 0
    boundary = trained & (staleness == 0) & has_stale[sample]
    fresh = trained & (staleness == 0) & ~boundary
    abs_diff, ratio_dev = x.abs(), torch.expm1(-x).abs()
    zero = x.new_zeros(())
    return {
        "fresh_tokens": fresh.sum().double(), "fresh_abs_diff": abs_diff[fresh].sum(),
        "fresh_kl": (torch.expm1(-x) + x)[fresh].sum(),
        "stale_tokens": stale.sum().double(), "stale_abs_diff": abs_diff[stale].sum(),
        "boundary_tokens": boundary.sum().double(), "boundary_abs_diff": abs_diff[boundary].sum(),
        "outside_mask": outside_mask.detach().to(x),
        "fresh_ratio_dev_max": ratio_dev[fresh].max() if fresh.any() else zero,
        "stale_ratio_dev_max": ratio_dev[stale].max() if stale.any() else zero,
        "current_abs_diff_max": abs_diff[fresh | boundary].max() if (fresh | boundary).any() else zero,
    }


def empty_mismatch(device: torch.device) -> dict[str, torch.Tensor]:
    """The :func:`mismatch_sums` of no tokens (a padding-only micro-batch), on ``device``."""
    return {k: torch.zeros((), dtype=torch.float64, device=device) for k in SUMMED + MAXED}


def reduce_mismatch(parts: Sequence[Mapping[str, torch.Tensor]],
                    group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Totals of :func:`mismatch_sums` results (at least one): summed or maxed over ``parts`` and,
    with ``group`` (the data-parallel group), over its ranks."""
    sums = torch.stack([torch.stack([p[k] for k in SUMMED]) for p in parts]).sum(0)
    maxes = torch.stack([torch.stack([p[k] for k in MAXED]) for p in parts]).amax(0)
    if group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(SUMMED + MAXED, sums.tolist() + maxes.tolist()))


def mismatch_metrics(totals: Mapping[str, float]) -> dict[str, float]:
    """Metric rows from reduced totals: ``mismatch/current_logprob_abs_diff`` (mean |trainer - rollout|),
    ``mismatch/current_logprob_abs_diff_max`` and ``mismatch/current_tokens`` (share of trained tokens)
    over current (fresh and boundary) tokens; ``mismatch/logprob_abs_diff`` (mean |trainer - rollout|),
    ``mismatch/kl`` (mean k3), ``mismatch/ratio_dev_max`` over fresh tokens; ``mismatch/fresh_tokens``
    (fresh share of trained tokens); ``staleness/logprob_drift`` (mean |trainer - rollout|) and
    ``staleness/ratio_dev_max`` over stale tokens; ``staleness/boundary_logprob_diff`` (mean |trainer -
    rollout|) and ``staleness/boundary_tokens`` (share of trained tokens) over boundary tokens;
    ``mismatch/tokens_outside_mask`` (count). A metric over an empty token set is left out."""
    fresh, stale, boundary = totals["fresh_tokens"], totals["stale_tokens"], totals["boundary_tokens"]
    out = {"mismatch/tokens_outside_mask": totals["outside_mask"]}
    trained = fresh + stale + boundary
    if trained > 0:
        out["mismatch/fresh_tokens"] = fresh / trained
    if fresh + boundary > 0:
        out |= {"mismatch/current_logprob_abs_diff": (totals["fresh_abs_diff"] + totals["boundary_abs_diff"])
                / (fresh + boundary), "mismatch/current_logprob_abs_diff_max": totals["current_abs_diff_max"],
                "mismatch/current_tokens": (fresh + boundary) / trained}
    if fresh > 0:
        out |= {"mismatch/logprob_abs_diff": totals["fresh_abs_diff"] / fresh,
                "mismatch/kl": totals["fresh_kl"] / fresh, "mismatch/ratio_dev_max": totals["fresh_ratio_dev_max"]}
    if stale > 0:
        out |= {"staleness/logprob_drift": totals["stale_abs_diff"] / stale,
                "staleness/ratio_dev_max": totals["stale_ratio_dev_max"]}
    if boundary > 0:
        out |= {"staleness/boundary_logprob_diff": totals["boundary_abs_diff"] / boundary,
                "staleness/boundary_tokens": boundary / trained}
    return out
