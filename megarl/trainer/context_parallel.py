"""Context parallelism (CP): which positions of a micro-batch's model input each CP rank feeds the
model, and per-token results gathered back from the CP ranks.

Megatron's GPTModel under CP expects each rank to hold only its part of every sequence, in the
load-balanced order transformer-engine's CP attention assumes (causal attention: early chunks are
cheap, late ones dear, so each rank takes one of each):

- BSHD (padded rows of ``s``): the sequence dim is cut into ``2·cp`` equal chunks and rank ``r``
  holds chunks ``r`` and ``2·cp-1-r``, back to back (megatron-core ``utils.py``
  ``_get_batch_on_this_cp_rank_per_sequence_balancing``: ``val.view(..., 2 * cp_size, s // (2 *
  cp_size), ...)`` then ``index_select`` of ``[cp_rank, 2 * cp_size - cp_rank - 1]``; the same split
  as ``rope_utils.get_pos_emb_on_this_cp_rank``). ``s`` must be a multiple of ``2·cp``.
- THD (one packed row): every sequence is padded to a multiple of ``2·cp`` (``cu_seqlens_padded``),
  cut into ``2·cp`` chunks, and rank ``r`` holds chunks ``r`` and ``2·cp-1-r`` of every sequence,
  sequence after sequence (transformer-engine ``thd_get_partitioned_indices``,
  ``transformer_engine/pytorch/csrc/extensions/attention.cu``, whose kernel
  ``thd_partition_indices_kernel`` in ``transformer_engine/common/fused_attn/context_parallel.cu``
  maps local token ``t`` of sequence ``i`` with local length ``l = padded_i / cp`` to
  ``cu_seqlens_padded[i] + t + (l / 2) * (r if t < l / 2 else 2·cp - 2 - r)``). Megatron's THD
  RoPE (``rope_utils._apply_rotary_pos_emb_thd`` / ``_get_thd_freqs_on_this_cp_rank``) takes each
  rank's positions itself from ``cu_seqlens_q_padded``, so ``max_seqlen`` must cover the longest
  padded sequence.

Per-token results come back with :meth:`ContextParallelSplit.gather`, an all-gather over the CP group
that is differentiable: its backward hands each rank the gradient of its own positions only (no sum
over ranks). The RL loss is computed on whole per-sample rows (sequence means), so every CP rank
computes the same ``loss_sum`` of the whole micro-batch from the gathered log-probs, and backward
sends each rank d loss_sum / d (its tokens' log-probs): the parameter gradients of the CP ranks of one
replica add up to exactly the cp=1 gradient of ``loss_sum`` (transformer-engine's CP attention
backward returns the gradient of the keys and values to the rank that holds them).

Scaling: with ``calculate_per_token_loss`` megatron sums the gradients over the DP×CP group (no
pre-scaling, ``distributed_data_parallel.py``), all-reduces the ``num_tokens`` every micro-batch's loss
function returns over the same DP×CP group and divides the gradients by it
(``finalize_model_grads.py``, ``schedules.forward_step_calc_loss``). So ``loss_sum`` is returned
unscaled and the micro-batch's integer token count is split over its CP ranks
(:func:`token_count_share`): the DP×CP sum of ``num_tokens`` is then the cp=1 count and the gradient
the cp=1 gradient. (A loss over local tokens only, as the SFT cross-entropy, instead returns the sum
and count of its local tokens, megatron's own convention; both add up to the cp=1 values.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megarl.trainer.device import to_device


@dataclass(frozen=True)
class ContextParallelRank:
    """This process's place in its CP group: ``size`` ranks, ``rank`` in it, ``group`` the process
    group (None: no communication, for building a rank's inputs only)."""

    size: int
    rank: int
    group: Optional[dist.ProcessGroup] = None

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"context-parallel rank {self.rank} is not in 0..{self.size - 1}")


def this_cp_rank() -> Optional[ContextParallelRank]:
    """Megatron's CP group of this process, or None when it has a single rank (no CP)."""
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return None
    return ContextParallelRank(size, parallel_state.get_context_parallel_rank(),
                               parallel_state.get_context_parallel_group())


def row_length_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What a model-input row length must be a multiple of: ``2·cp`` for the CP split (cp > 1), and
    each rank's ``length / cp`` a multiple of ``tp`` under sequence parallelism."""
    split = 2 * cp if cp > 1 else 1
    return math.lcm(split, cp * tp) if sequence_parallel else split


def padded_lengths(lengths: torch.Tensor, cp: int) -> torch.Tensor:
    """Sequence lengths int64 [k] rounded up to a multiple of ``2·cp`` (unchanged for cp = 1): the
    THD layout's per-sequence padding."""
    multiple = 2 * cp if cp > 1 else 1
    return -(-lengths.long() // multiple) * multiple


def bshd_partitioned_indices(length: int, cp: int, rank: int) -> torch.Tensor:
    """Column indices int64 [length / cp] that CP ``rank`` holds of a row of ``length``: chunks
    ``rank`` and ``2·cp-1-rank`` of ``2·cp`` (megatron-core's BSHD split, see the module docstring)."""
    if length % (2 * cp):
        raise ValueError(f"a row of {length} positions does not cut into {2 * cp} chunks (cp={cp})")
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def thd_partitioned_indices(cu_seqlens_padded: torch.Tensor, total: int, cp: int, rank: int) -> torch.Tensor:
    """Positions int64 [total / cp] of a packed row that CP ``rank`` holds, in its order: chunks
    ``rank`` and ``2·cp-1-rank`` of every sequence, sequence after sequence (transformer-engine's
    ``thd_get_partitioned_indices``, see the module docstring). ``cu_seqlens_padded`` int [k + 1]
    from 0 to ``total``, every sequence a multiple of ``2·cp``."""
    cu = cu_seqlens_padded.long()
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total or (lengths < 0).any():
        raise ValueError(f"cu_seqlens_padded must rise from 0 to the row's {total} positions, got {cu.tolist()}")
    if (lengths % (2 * cp)).any():
        raise ValueError(f"padded sequence lengths {lengths.tolist()} are not all multiples of 2·cp = {2 * cp}")
    chunk = lengths // (2 * cp)
    starts = torch.stack([cu[:-1] + rank * chunk, cu[:-1] + (2 * cp - 1 - rank) * chunk], dim=1).reshape(-1)
    counts = chunk.repeat_interleave(2)
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return torch.repeat_interleave(starts, counts) + within


def token_count_share(count: torch.Tensor, cp: ContextParallelRank) -> torch.Tensor:
    """This CP rank's integer share of a micro-batch's token count ``count`` (int scalar): shares of
    ``count // size`` plus one on the first ``count % size`` ranks, adding up to ``count`` over the
    group (see the module docstring on scaling)."""
    return count // cp.size + (cp.rank < count % cp.size).to(count.dtype)


class _AllGatherOwnGradient(torch.autograd.Function):
    """[m, ...] on each rank -> [size, m, ...] in rank order; backward: this rank's slice of the
    gradient (each rank's own positions, not summed over ranks)."""

    @staticmethod
    def forward(ctx, local, rank, size, group):
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rank = rank
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None, None, None


@dataclass(frozen=True)
class ContextParallelSplit:
    """Where the ``P = b·s`` positions of one micro-batch's model input [b, s] (flattened row-major)
    go over the CP ranks. ``positions`` int64 [size, P / size]: row ``r`` the flat positions rank
    ``r`` holds, in its local [b, s / size] row-major order; together every position exactly once."""

    positions: torch.Tensor
    cp: ContextParallelRank

    @property
    def mine(self) -> torch.Tensor:
        """The flat positions int64 [P / size] this rank holds."""
        return self.positions[self.cp.rank]

    def to(self, device: torch.device) -> ContextParallelSplit:
        """This split with its positions on ``device``."""
        return ContextParallelSplit(to_device(self.positions, device), self.cp)

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part [P / size, ...] of per-position values ``whole`` [P, ...] (on the
        positions' device)."""
        return whole[self.mine]

    def local_position(self, flat: torch.Tensor) -> torch.Tensor:
        """For flat positions ``flat`` int64 [n] (on the positions' device), their position in this
        rank's local flattened output, -1 where another rank holds them."""
        where = torch.full((self.positions.numel(),), -1, dtype=torch.long, device=self.positions.device)
        where[self.mine] = torch.arange(self.mine.numel(), device=self.positions.device)
        return where[flat]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-position values ``local`` [P / size, ...] of every rank -> [P, ...] of the whole input,
        differentiable: the backward gives this rank the gradient of its own positions. ``local`` on
        the CP group's device (the positions' too)."""
        if self.cp.group is None:
            raise ValueError("gathering over the CP ranks needs their process group")
        stacked = _AllGatherOwnGradient.apply(local, self.cp.rank, self.cp.size, self.cp.group)
        order = torch.argsort(self.positions.reshape(-1))
        return stacked.reshape(-1, *local.shape[1:])[order]


def bshd_split(rows: int, length: int, cp: ContextParallelRank) -> ContextParallelSplit:
    """The split of ``rows`` padded rows of ``length`` (see :func:`bshd_partitioned_indices`)."""
    columns = torch.stack([bshd_partitioned_indices(length, cp.size, r) for r in range(cp.size)])  # [size, s/size]
    offsets = torch.arange(rows)[None, :, None] * length
    return ContextParallelSplit((offsets + columns[:, None, :]).reshape(cp.size, -1), cp)


def thd_split(cu_seqlens_padded: torch.Tensor, length: int, cp: ContextParallelRank) -> ContextParallelSplit:
    """The split of one packed row of ``length`` (see :func:`thd_partitioned_indices`)."""
    return ContextParallelSplit(
        torch.stack([thd_partitioned_indices(cu_seqlens_padded, length, cp.size, r) for r in range(cp.size)]), cp)
