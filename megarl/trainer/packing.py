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
results back to the ragged layout. Under context parallelism each CP rank reads its part of the
input (:mod:`megarl.trainer.context_parallel`): packed sequences are then each padded to a multiple
of 2·cp, and per-token results come back from all CP ranks.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Optional

import torch

from megarl.trainer.context_parallel import (
    ContextParallelRank,
    ContextParallelSplit,
    bshd_split,
    padded_lengths,
    thd_split,
)
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
                       length_multiple: int = 1, cp: int = 1, count_multiple: int = 1) -> MicroBatchPlan:
    """Sequences per DP rank and micro-batch (see the module docstring). ``lengths`` int [B]; ``cp``:
    context-parallel ranks, a packed sequence then takes its length padded to a multiple of 2·cp;
    ``count_multiple``: the number of micro-batches is a multiple of it (:func:`micro_batch_count_multiple`;
    packed: padding-only micro-batches make it up, padded: ValueError when no equal split has such a count)."""
    sizes = [int(n) for n in (padded_lengths(lengths, cp) if pack else lengths)]
    if pack:
        shares = balanced_partition(sizes, dp)
        count = max(max(first_fit_count([sizes[i] for i in share], max_tokens), 1) for share in shares)
        count = _round_up(count, count_multiple)
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
    rows = _largest_fitting_divisor(per_rank_count, length, max_tokens, count_multiple)
    per_rank = [[list(range(r * per_rank_count + i, r * per_rank_count + i + rows))
                 for i in range(0, per_rank_count, rows)] for r in range(dp)]
    return MicroBatchPlan(per_rank, length, packed=False)


def _largest_fitting_divisor(num_rows: int, seq_length: int, max_tokens: int, count_multiple: int = 1) -> int:
    """The largest divisor of ``num_rows`` whose ``rows * seq_length`` fits ``max_tokens`` (>= 1) and
    that leaves a multiple of ``count_multiple`` micro-batches: equal micro-batches, as pipeline stages
    exchange fixed-shape activations. ValueError when there is none."""
    budget = max(1, max_tokens // seq_length)
    count = -(-num_rows // budget)
    while num_rows % count or count % count_multiple:
        count += 1
        if count > num_rows:
            raise ValueError(f"{num_rows} padded rows per data-parallel rank do not split into equal micro-batches "
                             f"of a count divisible by {count_multiple} (the pipeline's virtual stages need it); "
                             "pack the micro-batches (trainer.pack_sequences=true)")
    return num_rows // count


def micro_batch_count_multiple() -> int:
    """What the number of micro-batches of a step must be a multiple of for megatron's schedule on this
    rank's layout: the pipeline's size under virtual stages (the interleaved schedule runs micro-batches in
    groups of that many, ``microbatch_group_size_per_vp_stage``, and refuses a last group smaller than the
    pipeline), else 1."""
    from megatron.core import parallel_state

    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is None:
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


@dataclass
class ModelInput:
    """One micro-batch as this rank's model reads it: ``tokens``/``position_ids`` int64 [b, s]
    (under context parallelism this CP rank's part, ``s`` = the row length / cp);
    ``packed_seq_params`` (THD) when packed, else None; ``flat_index`` int64 [n]: the position of
    each ragged token in the flattened [b * s * cp] input of the whole micro-batch; ``split``: where
    those positions go over the CP ranks (:mod:`megarl.trainer.context_parallel`), None without CP."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: Optional[object]
    flat_index: torch.Tensor
    split: Optional[ContextParallelSplit] = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    @property
    def row_length(self) -> int:
        """The whole micro-batch's row length (``s`` times the CP ranks)."""
        return self.shape[1] * (1 if self.split is None else self.split.cp.size)

    @property
    def local_index(self) -> torch.Tensor:
        """int64 [n]: each ragged token's position in this rank's flattened [b * s] output, -1 where
        another CP rank holds it."""
        return self.flat_index if self.split is None else self.split.local_position(self.flat_index)

    def to(self, device: torch.device) -> ModelInput:
        """This input on ``device`` (THD boundaries included: transformer-engine reads int32
        ``cu_seqlens`` on the GPU; the CP split too)."""
        params = self.packed_seq_params
        if params is not None:
            params = dataclasses.replace(params, **{f.name: to_device(getattr(params, f.name), device)
                                                    for f in dataclasses.fields(params)
                                                    if isinstance(getattr(params, f.name), torch.Tensor)})
        return ModelInput(to_device(self.tokens, device), to_device(self.position_ids, device), params,
                          to_device(self.flat_index, device), None if self.split is None else self.split.to(device))

    def scatter(self, values: torch.Tensor, fill) -> torch.Tensor:
        """Ragged ``values`` [n, ...] -> this rank's [b, s, ...], ``fill`` (a scalar or a [...] tensor)
        elsewhere, on ``values``' device (which must be this input's)."""
        b, s = self.shape
        out = torch.empty((b * self.row_length, *values.shape[1:]), dtype=values.dtype, device=values.device)
        out[:] = fill
        out[self.flat_index] = values
        if self.split is not None:
            out = self.split.local(out)
        return out.view(b, s, *values.shape[1:])

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's [b * s, ...] per-position results -> ragged [n, ...] of the whole micro-batch
        (under CP an all-gather over the CP group, differentiable: see
        :meth:`ContextParallelSplit.gather`)."""
        if self.split is not None:
            flat = self.split.gather(flat)
        return flat[self.flat_index]

    def to_ragged(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``values`` [m] of the ragged tokens ``rows`` int64 [m] (all held by this rank) -> ragged [n]
        with every CP rank's values, 0 at tokens no rank gave (differentiable in ``values``)."""
        if self.split is None:
            return values.new_zeros(len(self.flat_index)).index_put((rows,), values)
        b, s = self.shape
        return self.gather(values.new_zeros(b * s).index_put((self.local_index[rows],), values))


def model_input(cu_seqlens: torch.Tensor, tokens: torch.Tensor, pad_id: int, length: int, packed: bool,
                cp: Optional[ContextParallelRank] = None) -> ModelInput:
    """The model input of ragged ``tokens`` [n] whose sequences ``cu_seqlens`` [k + 1] (local, from
    0) delimits: one packed row of ``length`` or k padded rows of ``length``; with ``cp`` (more than
    one CP rank) this rank's part of it, each packed sequence padded to a multiple of 2·cp."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n = int(cu_seqlens[-1])
    local_pos = torch.arange(n) - torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    if packed:
        return _packed_input(lengths, local_pos, tokens, pad_id, length, cp)
    b = max(len(lengths), 1)
    if n and int(lengths.max()) > length:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit a row of {length}")
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    flat_index = rows * length + local_pos
    grid = torch.full((b * length,), pad_id, dtype=torch.long)
    grid[flat_index] = tokens
    positions = torch.arange(length).expand(b, length)
    if cp is None:
        return ModelInput(grid.view(b, length), positions, None, flat_index)
    split = bshd_split(b, length, cp)
    local = (b, length // cp.size)
    return ModelInput(split.local(grid).view(local), split.local(positions.reshape(-1)).view(local), None,
                      flat_index, split)


def _packed_input(lengths: torch.Tensor, local_pos: torch.Tensor, tokens: torch.Tensor, pad_id: int, length: int,
                  cp: Optional[ContextParallelRank]) -> ModelInput:
    """One packed row: sequence ``i`` from its padded start (:func:`padded_lengths`), the tail (to
    ``length``) a padding sequence of its own, attending only to itself."""
    padded = padded_lengths(lengths, 1 if cp is None else cp.size)
    starts = torch.cumsum(padded, 0) - padded
    used = int(padded.sum())
    if used > length:
        raise ValueError(f"{int(lengths.sum())} tokens ({used} with their padding) do not fit a packed row of {length}")
    flat_index = torch.repeat_interleave(starts, lengths) + local_pos
    row = torch.full((length,), pad_id, dtype=torch.long)
    row[flat_index] = tokens
    tail = [length - used] if length > used else []
    real, segments = torch.cat([lengths, torch.tensor(tail, dtype=torch.long)]), torch.cat(
        [padded, torch.tensor(tail, dtype=torch.long)])
    positions = torch.arange(length) - torch.repeat_interleave(torch.cumsum(segments, 0) - segments, segments)
    cu_real, cu_padded = (torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(x, 0).to(torch.int32)])
                          for x in (real, segments))
    longest = int(segments.max())
    if cp is None:
        return ModelInput(row[None], positions[None], _thd_params(cu_real, longest), flat_index)
    split = thd_split(cu_padded, length, cp)
    return ModelInput(split.local(row)[None], split.local(positions)[None], _thd_params(cu_real, longest, cu_padded),
                      flat_index, split)


def _thd_params(cu_seqlens: torch.Tensor, max_seqlen: int, cu_seqlens_padded: Optional[torch.Tensor] = None):
    """Megatron's THD parameters: ``cu_seqlens`` int32 of the real lengths, ``cu_seqlens_padded``
    (under CP) of the padded ones, ``max_seqlen`` the longest padded sequence (RoPE's table length)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
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
