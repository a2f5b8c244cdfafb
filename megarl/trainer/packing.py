"""Ragged sequences -> micro-batches -> model inputs: packed (THD, no padding) or right-padded rows.

A global batch is held ragged: every per-token field is one tensor over all N positions of all
sequences, ``cu_seqlens`` int64 [B + 1] marks where each sequence starts. :func:`plan_micro_batches`
gives each data-parallel rank its sequences and cuts them into micro-batches:

- packed (``pack=True``): sequences go to DP ranks balanced by token count (longest first to the
  rank with the fewest tokens, the greedy partition verl and slime use), each rank's share is cut
  into the fewest micro-batches of about ``max_tokens`` tokens (first-fit decreasing), every rank
  gets as many micro-batches as the rank that needs most (EP all-to-alls and PP stages run in
  lock-step), and each rank's micro-batches are balanced again. Every micro-batch is one row of
  ``length`` tokens: its sequences back to back, the tail (to a common length, a multiple of
  ``length_multiple``) one padding segment of its own.
- padded (``pack=False``): contiguous equal DP shares and equal micro-batches of right-padded rows,
  all ``length`` = the longest sequence (rounded up to ``length_multiple``) long.

:func:`model_input` builds what the model reads for one micro-batch, with ``flat_index``: where each
ragged position lands in the flattened ``[b * s]`` model output (increasing), to take per-token
results back to the ragged layout.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Optional

import torch

from megarl.trainer.device import to_device


@dataclass(frozen=True)
class MicroBatchPlan:
    """Sequence indices per DP rank per micro-batch (an empty list: a padding-only micro-batch),
    the common row length, and whether rows are packed."""

    per_rank: list[list[list[int]]]
    length: int
    packed: bool

    @property
    def num_micro_batches(self) -> int:
        return len(self.per_rank[0])

    def padding_frac(self, lengths: torch.Tensor) -> float:
        """Share of the model's input positions (over all ranks) that are padding."""
        real = int(lengths.sum())
        rows = sum(1 if self.packed else max(len(mb), 1) for rank in self.per_rank for mb in rank)
        total = rows * self.length
        return 1.0 - real / total if total else 0.0

    def rank_tokens(self, lengths: torch.Tensor) -> list[int]:
        """Real tokens per DP rank."""
        return [int(sum(int(lengths[i]) for mb in rank for i in mb)) for rank in self.per_rank]

    def imbalance(self, lengths: torch.Tensor) -> float:
        """max / mean real tokens per DP rank (1.0 = perfectly balanced)."""
        tokens = self.rank_tokens(lengths)
        mean = sum(tokens) / len(tokens)
        return max(tokens) / mean if mean else 1.0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices into ``parts`` groups with sums as even as the greedy rule makes them: longest first,
    each to the group with the smallest sum (ties: fewer items, then lower group). Indices inside a
    group are ascending."""
    heap = [(0, 0, g) for g in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, count, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (total + lengths[i], count + 1, g))
    return [sorted(g) for g in groups]


def first_fit_count(lengths: list[int], capacity: int) -> int:
    """How many bins of ``capacity`` first-fit decreasing needs (a longer item fills a bin alone)."""
    free: list[int] = []
    for n in sorted(lengths, reverse=True):
        for b, room in enumerate(free):
            if n <= room:
                free[b] -= n
                break
        else:
            free.append(capacity - n)
    return len(free)


def plan_micro_batches(lengths: torch.Tensor, dp: int, max_tokens: int, *, pack: bool,
                       length_multiple: int = 1) -> MicroBatchPlan:
    """Sequences per DP rank and micro-batch (see the module docstring). ``lengths`` int [B]."""
    sizes = [int(n) for n in lengths]
    if pack:
        shares = balanced_partition(sizes, dp)
        count = max(max(first_fit_count([sizes[i] for i in share], max_tokens), 1) for share in shares)
        per_rank = []
        for share in shares:
            bins = balanced_partition([sizes[i] for i in share], count)
            per_rank.append([[share[j] for j in b] for b in bins])
        longest = max(sum(sizes[i] for i in mb) for rank in per_rank for mb in rank)
        return MicroBatchPlan(per_rank, _round_up(max(longest, 1), length_multiple), packed=True)
    if len(sizes) % dp:
        raise ValueError(f"{len(sizes)} samples do not split over {dp} data-parallel ranks")
    length = _round_up(max(sizes), length_multiple)
    per_rank_count = len(sizes) // dp
    rows = _largest_fitting_divisor(per_rank_count, length, max_tokens)
    per_rank = [[list(range(r * per_rank_count + i, r * per_rank_count + i + rows))
                 for i in range(0, per_rank_count, rows)] for r in range(dp)]
    return MicroBatchPlan(per_rank, length, packed=False)


def _largest_fitting_divisor(num_rows: int, seq_length: int, max_tokens: int) -> int:
    """The largest divisor of ``num_rows`` whose ``rows * seq_length`` fits ``max_tokens`` (>= 1):
    equal micro-batches, as pipeline stages exchange fixed-shape activations."""
    budget = max(1, max_tokens // seq_length)
    count = -(-num_rows // budget)
    while num_rows % count:
        count += 1
    return num_rows // count


@dataclass
class ModelInput:
    """One micro-batch as the model reads it: ``tokens``/``position_ids`` int64 [b, s];
    ``packed_seq_params`` (THD) when packed, else None; ``flat_index`` int64 [n]: the position of
    each ragged token in the flattened [b * s] output."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: Optional[object]
    flat_index: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def to(self, device: torch.device) -> ModelInput:
        """This input on ``device`` (THD boundaries included: transformer-engine reads int32
        ``cu_seqlens`` on the GPU)."""
        params = self.packed_seq_params
        if params is not None:
            params = dataclasses.replace(params, **{f.name: to_device(getattr(params, f.name), device)
                                                    for f in dataclasses.fields(params)
                                                    if isinstance(getattr(params, f.name), torch.Tensor)})
        return ModelInput(to_device(self.tokens, device), to_device(self.position_ids, device), params,
                          to_device(self.flat_index, device))

    def scatter(self, values: torch.Tensor, fill) -> torch.Tensor:
        """Ragged ``values`` [n, ...] -> [b, s, ...], ``fill`` (a scalar or a [...] tensor) elsewhere,
        on ``values``' device (which must be this input's)."""
        b, s = self.shape
        out = torch.empty((b * s, *values.shape[1:]), dtype=values.dtype, device=values.device)
        out[:] = fill
        out[self.flat_index] = values
        return out.view(b, s, *values.shape[1:])

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """[b * s, ...] per-position results -> ragged [n, ...]."""
        return flat[self.flat_index]


def model_input(cu_seqlens: torch.Tensor, tokens: torch.Tensor, pad_id: int, length: int, packed: bool) -> ModelInput:
    """The model input of ragged ``tokens`` [n] whose sequences ``cu_seqlens`` [k + 1] (local, from
    0) delimits: one packed row of ``length`` or k padded rows of ``length``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n = int(cu_seqlens[-1])
    local_pos = torch.arange(n) - torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    if packed:
        if n > length:
            raise ValueError(f"{n} tokens do not fit a packed row of {length}")
        row = torch.full((length,), pad_id, dtype=torch.long)
        row[:n] = tokens
        positions = torch.zeros(length, dtype=torch.long)
        positions[:n] = local_pos
        bounds = cu_seqlens.to(torch.int32)
        if length > n:  # the tail is a padding sequence of its own, attending only to itself
            positions[n:] = torch.arange(length - n)
            bounds = torch.cat([bounds, torch.tensor([length], dtype=torch.int32)])
        longest = int((bounds[1:] - bounds[:-1]).max())
        return ModelInput(row[None], positions[None], _thd_params(bounds, longest), torch.arange(n))
    b = max(len(lengths), 1)
    if n and int(lengths.max()) > length:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit a row of {length}")
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    flat_index = rows * length + local_pos
    grid = torch.full((b * length,), pad_id, dtype=torch.long)
    grid[flat_index] = tokens
    return ModelInput(grid.view(b, length), torch.arange(length).expand(b, length), None, flat_index)


def _thd_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def to_grid(values: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Ragged [n] -> [k, longest] right-padded with ``fill`` (differentiable in ``values``), on the
    device of ``values`` and ``cu_seqlens`` (one device)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    k = len(lengths)
    width = int(lengths.max()) if k else 0
    device = values.device
    rows = torch.repeat_interleave(torch.arange(k, device=device), lengths)
    cols = torch.arange(len(values), device=device) - torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    out = values.new_full((k, width), fill)
    return out.index_put((rows, cols), values)
