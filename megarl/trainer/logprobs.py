"""Log-probs and entropy of target tokens from vocab-parallel logits, with Keep Sampling Mask.

Each tensor-parallel rank holds a logits shard ``[N, V/tp]`` covering vocab ids
``[vocab_start, vocab_start + V/tp)``. No rank ever builds an ``[N, V]`` tensor: ranks combine
per-row maxima and sums with all-reduces (as megatron-core's vocab-parallel cross-entropy does), and
the backward pass needs no communication. Under Keep Sampling Mask the log-prob is taken over the
ids the engine kept at that position (the others set to -inf on every shard); a target the engine
reported outside its own mask is added to the kept ids and counted, never an error. The entropy is
always that of the unmasked distribution. Logits must already be divided by the sampling temperature.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CsrMask:
    """Kept vocab ids per position: row i keeps ``ids[offsets[i]:offsets[i + 1]]``.

    ``ids`` int32 [nnz], ``offsets`` int32 [N + 1]. An empty row means "no mask at this position"
    (full vocabulary): the engine returns at least the sampled id, so an empty row only comes from
    samples (or prompt positions) that have no mask. ``logprobs`` float32 [nnz] or None: the engine's
    log-prob of each kept id (:attr:`megarl.sample.SamplingMask.logprobs`).
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    logprobs: Optional[torch.Tensor] = None


def csr_rows(mask: CsrMask, rows: torch.Tensor) -> CsrMask:
    """The rows ``rows`` (int64 [M], any order, on ``mask``'s device) of ``mask`` as a mask of M rows, in
    that order."""
    counts = (mask.offsets[1:] - mask.offsets[:-1]).long()[rows]
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long, device=counts.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    starts = mask.offsets[:-1].long()[rows]
    within = torch.arange(int(offsets[-1]), device=counts.device) - offsets[:-1].repeat_interleave(counts)
    taken = starts.repeat_interleave(counts) + within
    return CsrMask(mask.ids[taken], offsets, None if mask.logprobs is None else mask.logprobs[taken])


def csr_entries(mask: CsrMask, entries: torch.Tensor) -> CsrMask:
    """The mask of ``mask``'s rows keeping only the flat ``entries`` (int64 [k], positions into its ``ids``,
    grouped row after row as :func:`megarl.algos.score_centering.head` gives them)."""
    counts = (mask.offsets[1:] - mask.offsets[:-1]).long()
    row_of = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)[entries]
    offsets = torch.zeros(len(counts) + 1, dtype=torch.long, device=counts.device)
    torch.cumsum(torch.bincount(row_of, minlength=len(counts)), 0, out=offsets[1:])
    return CsrMask(mask.ids[entries], offsets, None if mask.logprobs is None else mask.logprobs[entries])


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor  # [N], log-prob of the target over its kept set (differentiable)
    entropy: torch.Tensor  # [N], entropy of the unmasked distribution (differentiable)
    outside_mask: torch.Tensor  # int64 scalar: positions whose target was not in its non-empty mask row
    support_logprobs: Optional[torch.Tensor] = None  # [nnz] of ``support``: each id's log-prob over its kept set


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: Optional[dist.ProcessGroup]) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


class _MaskedTargetLogprob(torch.autograd.Function):
    """``log softmax(z masked to kept)[target]`` over the union of vocab shards; d/dz = onehot - p_masked."""

    @staticmethod
    def forward(ctx, logits, keep, target_local, on_rank, group):
        z = logits if keep is None else logits.masked_fill(~keep, float("-inf"))
        row_max = z.max(dim=1).values
        _all_reduce(row_max, dist.ReduceOp.MAX, group)
        shifted = z - row_max[:, None]
        exp = shifted.exp()
        target_shifted = shifted.gather(1, target_local[:, None]).squeeze(1)
        stats = torch.stack(
            [exp.sum(dim=1), torch.where(on_rank, target_shifted, torch.zeros_like(target_shifted)),
             on_rank.to(z.dtype)],
            dim=1,
        )
        _all_reduce(stats, dist.ReduceOp.SUM, group)
        owners = stats[:, 2]
        if (owners != 1).any():
            row = int((owners != 1).nonzero()[0])
            raise ValueError(f"target id at position {row} is outside the vocabulary "
                             f"(held by {int(owners[row])} shards, expected 1)")
        sum_exp = stats[:, 0]
        ctx.save_for_backward(exp / sum_exp[:, None], target_local, on_rank)
        return stats[:, 1] - sum_exp.log()

    @staticmethod
    def backward(ctx, grad_logprob):
        probs, target_local, on_rank = ctx.saved_tensors
        grad_logits = probs * -grad_logprob[:, None]
        rows = on_rank.nonzero().squeeze(1)
        grad_logits[rows, target_local[rows]] += grad_logprob[rows]
        return grad_logits, None, None, None, None


class _MaskedIdLogprobs(torch.autograd.Function):
    """``log softmax(z masked to kept)[id]`` for several ids per row (flat: row ``rows[e]``, local id ``local[e]``
    on the shard that holds it); d/dz_j of entry e = [j = id_e] - p_masked(j) on its row."""

    @staticmethod
    def forward(ctx, logits, keep, rows, local, on_rank, group):
        z = logits if keep is None else logits.masked_fill(~keep, float("-inf"))
        row_max = z.max(dim=1).values
        _all_reduce(row_max, dist.ReduceOp.MAX, group)
        shifted = z - row_max[:, None]
        exp = shifted.exp()
        picked = torch.where(on_rank, shifted[rows, local], torch.zeros_like(rows, dtype=z.dtype))
        stats = torch.cat([exp.sum(dim=1), picked, on_rank.to(z.dtype)])
        _all_reduce(stats, dist.ReduceOp.SUM, group)
        m, n = len(row_max), len(rows)
        sum_exp, picked, owners = stats[:m], stats[m:m + n], stats[m + n:]
        if (owners != 1).any():
            entry = int((owners != 1).nonzero()[0])
            raise ValueError(f"the id of entry {entry} (row {int(rows[entry])}) is outside the vocabulary (held by "
                             f"{int(owners[entry])} shards, expected 1)")
        ctx.save_for_backward(exp / sum_exp[:, None], rows, local, on_rank)
        return picked - sum_exp.log()[rows]

    @staticmethod
    def backward(ctx, grad_logprob):
        probs, rows, local, on_rank = ctx.saved_tensors
        per_row = torch.zeros(len(probs), dtype=grad_logprob.dtype, device=grad_logprob.device)
        per_row.index_add_(0, rows, grad_logprob)
        grad_logits = probs * -per_row[:, None]
        grad_logits.index_put_((rows[on_rank], local[on_rank]), grad_logprob[on_rank], accumulate=True)
        return grad_logits, None, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """``H = -sum_j p_j log p_j = log S - sum_j p_j (z_j - max)``; dH/dz_j = -p_j (log p_j + H)."""

    @staticmethod
    def forward(ctx, logits, group):
        row_max = logits.max(dim=1).values
        _all_reduce(row_max, dist.ReduceOp.MAX, group)
        shifted = logits - row_max[:, None]
        exp = shifted.exp()
        stats = torch.stack([exp.sum(dim=1), (exp * shifted).sum(dim=1)], dim=1)
        _all_reduce(stats, dist.ReduceOp.SUM, group)
        log_sum_exp = stats[:, 0].log()
        entropy = log_sum_exp - stats[:, 1] / stats[:, 0]
        ctx.save_for_backward(logits, row_max, log_sum_exp, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy):
        logits, row_max, log_sum_exp, entropy = ctx.saved_tensors
        log_probs = logits - row_max[:, None] - log_sum_exp[:, None]
        return -log_probs.exp() * (log_probs + entropy[:, None]) * grad_entropy[:, None], None


def _kept_in_shard(mask: CsrMask, targets: torch.Tensor, vocab_start: int,
                   shard_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool [N, V/tp]: which ids of this shard are kept, int64 scalar: rows whose target is not in
    their non-empty mask). Rows without a mask keep everything; a target outside its mask is kept too.

    Raises ValueError on a malformed CSR.
    """
    n = targets.numel()
    ids, offsets = mask.ids, mask.offsets
    if ids.dim() != 1 or offsets.shape != (n + 1,) or ids.is_floating_point() or offsets.is_floating_point():
        raise ValueError(f"sampling mask must be integer ids [nnz] and offsets [N+1] with N={n}; "
                         f"got {tuple(ids.shape)}, {tuple(offsets.shape)}")
    counts = offsets[1:] - offsets[:-1]
    if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or (counts < 0).any():
        raise ValueError(f"sampling mask offsets must rise from 0 to nnz={ids.numel()}; "
                         f"got {offsets[0].item()}..{offsets[-1].item()}")
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"sampling mask holds a negative vocab id {int(ids.min())}")
    rows = torch.repeat_interleave(torch.arange(n, device=ids.device), counts.long())
    ids = ids.long()
    target_hits = torch.zeros(n, dtype=torch.long, device=ids.device).index_add_(0, rows, (ids == targets[rows]).long())
    keep = torch.zeros(n, shard_size, dtype=torch.bool, device=ids.device)
    local = ids - vocab_start
    in_shard = (local >= 0) & (local < shard_size)
    keep[rows[in_shard], local[in_shard]] = True
    keep[counts == 0] = True
    target_local = targets - vocab_start
    owned = ((target_local >= 0) & (target_local < shard_size)).nonzero().squeeze(1)
    keep[owned, target_local[owned]] = True  # the sampled token is always in its kept set
    return keep, ((target_hits == 0) & (counts > 0)).sum()


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    vocab_start: int,
    targets: torch.Tensor,
    sampling_mask: Optional[CsrMask] = None,
    group: Optional[dist.ProcessGroup] = None,
    support: Optional[CsrMask] = None,
) -> TokenLogprobs:
    """Target log-probs (masked to the kept ids) and unmasked entropy from this rank's logits shard.

    ``logits`` float [N, V/tp] (bf16/fp16 are computed in float32), ``vocab_start`` the first vocab id
    of the shard, ``targets`` int [N] global vocab ids, ``sampling_mask`` replicated on all ranks (None =
    full vocabulary everywhere), ``group`` the tensor-parallel group (None = a single shard, no
    communication; note: not the default world group). A target outside its non-empty mask row is
    taken over that row plus the target and counted in ``outside_mask``. Every rank returns the same
    values; gradients reach this rank's shard only. ``support`` (N rows of ids, replicated; None: not asked):
    the log-prob of each of its ids over the same kept set as the target's (score centering's ``log pi(b)``),
    flat [nnz], taken with the targets' in one pass (one saved [N, V/tp] softmax for both).
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [N, V/tp] tensor, got {logits.dtype} {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1] or targets.is_floating_point():
        raise ValueError(f"targets must be integer [N] = {tuple(logits.shape[:1])}, "
                         f"got {targets.dtype} {tuple(targets.shape)}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    targets = targets.long()
    if targets.numel() and int(targets.min()) < 0:
        raise ValueError(f"target ids must be >= 0, got {int(targets.min())}")
    shard_size = logits.shape[1]
    keep, outside = None, torch.zeros((), dtype=torch.long, device=logits.device)
    if sampling_mask is not None:
        keep, outside = _kept_in_shard(sampling_mask, targets, vocab_start, shard_size)
    target_local = targets - vocab_start
    on_rank = (target_local >= 0) & (target_local < shard_size)
    target_local = torch.where(on_rank, target_local, torch.zeros_like(target_local))
    entropy = _VocabParallelEntropy.apply(logits, group)
    if support is None:
        return TokenLogprobs(_MaskedTargetLogprob.apply(logits, keep, target_local, on_rank, group), entropy, outside)
    if support.offsets.shape != (len(targets) + 1,):
        raise ValueError(f"support must have one row per target ({len(targets)}), got {len(support.offsets) - 1}")
    # the targets first, then the support's ids: one pass keeps one copy of the masked softmax for both
    counts = (support.offsets[1:] - support.offsets[:-1]).long()
    positions = torch.arange(len(targets), device=logits.device)
    local = support.ids.long() - vocab_start
    owned = (local >= 0) & (local < shard_size)
    rows = torch.cat([positions, torch.repeat_interleave(positions, counts)])
    both = _MaskedIdLogprobs.apply(logits, keep, rows, torch.cat([target_local, torch.where(owned, local, 0)]),
                                   torch.cat([on_rank, owned]), group)
    logprobs, support_logprobs = both[:len(targets)], both[len(targets):]
    return TokenLogprobs(logprobs, entropy, outside, support_logprobs)
