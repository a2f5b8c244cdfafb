"""The slice map of sharded resharding: which part of each HF tensor a trainer rank holds, which part an
engine rank loads, and which trainer rank sends which piece to which engine rank.

A :class:`Piece` is the rows ``[start, stop)`` along one dimension of an HF tensor (``dim`` None: the
whole tensor). How a tensor is split is a :class:`Split`, read on the trainer from megatron-bridge's
mapping of the parameter it comes from (:mod:`megarl.sync.local_export`): ``dim`` 0 for column-parallel
layers (fused QKV and gate/up included: each HF part is split along its rows), 1 for row-parallel ones,
None for replicated ones; ``kv_heads`` for the K and V parts of a fused QKV; ``expert`` for a routed
expert's tensors.

The engine side follows SGLang's weight loaders (``sglang.srt.layers.linear``, ``vocab_parallel_embedding``,
``moe.fused_moe_triton.layer``): engine rank ``r`` of ``tp`` ranks loads chunk ``r`` of ``tp`` along the
split dimension (``ColumnParallelLinear``, ``RowParallelLinear``, ``MergedColumnParallelLinear``, the
Q part of ``QKVParallelLinear``; ``VocabParallelEmbedding`` / ``ParallelLMHead`` after padding the
rows to a multiple of ``VOCAB_PADDING``); K and V heads chunk ``r // replicas`` of ``tp / replicas``
when there are fewer KV heads than ranks (``replicas = tp / kv_heads``); replicated tensors whole; a
routed expert only on the EP rank that owns it (``FusedMoE``: experts are split in contiguous runs of
``experts / ep`` over the EP ranks), chunked over the MoE-TP ranks (``tp / ep``) along its split
dimension. :func:`plan_transfers` intersects what every engine rank loads with what the trainer ranks
hold: a piece held by several ranks (replicated tensors, data-parallel copies) comes from one of them,
chosen so that the bytes spread over the holders. :class:`Piece` and :class:`Transfer` are the wire
format's (:mod:`megarl.engines.weight_shards`: the engine side reads them too).
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.engines.weight_shards import Piece, Transfer

VOCAB_PADDING = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE (rows of a vocab-parallel table per padding unit)


@dataclass(frozen=True)
class Split:
    """How an HF tensor is split over tensor-parallel ranks: along ``dim`` (None: replicated).
    ``kv_heads``: the tensor is the K or V part of a fused QKV with that many heads (0: it is not);
    ``expert``: the routed expert it belongs to (None: not an expert); ``vocab``: a vocab-parallel table."""

    dim: int | None
    kv_heads: int = 0
    expert: int | None = None
    vocab: bool = False


@dataclass(frozen=True)
class EngineRank:
    """Engine rank ``tp_rank`` of ``tp`` ranks whose routed experts are split over ``ep`` ranks
    (SGLang: MoE-TP size ``tp / ep``, EP rank ``tp_rank // (tp / ep)``)."""

    tp_rank: int
    tp: int
    ep: int = 1

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp


def chunk(size: int, parts: int, index: int, pad_to: int = 1) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` of ``parts`` equal chunks of ``size`` rows padded to a multiple
    of ``pad_to`` (the padding rows are cut off: the last chunks may be short or empty)."""
    padded = -(-size // pad_to) * pad_to
    if padded % parts:
        raise ValueError(f"{size} rows (padded to {padded}) do not split into {parts} equal chunks")
    per = padded // parts
    return min(index * per, size), min((index + 1) * per, size)


def engine_piece(name: str, dtype: str, shape: tuple[int, ...], split: Split, rank: EngineRank,
                 num_experts: int) -> Piece | None:
    """The part of HF tensor ``name`` that SGLang's loader of engine rank ``rank`` reads (None: none,
    a routed expert another EP rank owns)."""
    parts, index = rank.tp, rank.tp_rank
    if split.expert is not None:
        per_rank = num_experts // rank.ep
        if split.expert // per_rank != rank.ep_rank:
            return None
        parts, index = rank.moe_tp, rank.tp_rank % rank.moe_tp
    elif split.kv_heads and split.kv_heads < rank.tp:
        replicas = rank.tp // split.kv_heads
        parts, index = rank.tp // replicas, rank.tp_rank // replicas
    if split.dim is None or parts == 1:
        return Piece.whole(name, dtype, shape)
    start, stop = chunk(shape[split.dim], parts, index, VOCAB_PADDING if split.vocab else 1)
    return Piece(name, dtype, tuple(shape), split.dim, start, stop)


def intersect(held: Piece, wanted: Piece) -> Piece | None:
    """The part of ``wanted`` inside ``held`` (same tensor), or None when they do not overlap.
    Raises ValueError when both are split along different dimensions (a 2-D block, not a piece)."""
    if held.dim is None:
        return wanted
    if wanted.dim is None:
        return held
    if held.dim != wanted.dim:
        raise ValueError(f"{held.name}: held split along dim {held.dim}, loaded along dim {wanted.dim}")
    start, stop = max(held.start, wanted.start), min(held.stop, wanted.stop)
    return Piece(held.name, held.dtype, held.shape, held.dim, start, stop) if start < stop else None


def plan_transfers(holdings: list[tuple[int, Piece]], wants: list[tuple[int, Piece]]) -> list[Transfer]:
    """Every transfer that gives each engine rank what it loads: ``holdings`` (trainer rank, piece it
    holds), ``wants`` (engine rank, piece it loads). Of the holders of one same piece, the one that sends
    the fewest bytes so far sends it (the lowest rank on a tie): the senders' loads even out, so more
    links run at once. Raises ValueError naming a tensor part that no trainer rank holds."""
    by_name: dict[str, dict[Piece, list[int]]] = {}
    for src, piece in holdings:
        by_name.setdefault(piece.name, {}).setdefault(piece, []).append(src)
    out, sent = [], {}
    for dst, wanted in wants:
        covered = 0
        for held, sources in by_name.get(wanted.name, {}).items():
            part = intersect(held, wanted)
            if part is None:
                continue
            src = min(sources, key=lambda rank: (sent.get(rank, 0), rank))
            sent[src] = sent.get(src, 0) + part.nbytes
            out.append(Transfer(src, dst, part, held))
            covered += part.nbytes
        if covered != wanted.nbytes:
            raise ValueError(f"{wanted.name}: the trainer ranks hold {covered} of the {wanted.nbytes} bytes engine "
                             f"rank {dst} loads ({wanted.dim=}, rows {wanted.start}:{wanted.stop})")
    return out
