"""The slice map of sharded resharding: which part of each HF tensor a trainer rank holds, which part an
engine rank loads, and which trainer rank sends which piece to which engine rank.

A :class:`Piece` is the rows ``[start, stop)`` along one dimension of an HF tensor (``dim`` None: the
whole tensor). How a tensor is split is a :class:`Split`, read on the trainer from megatron-bridge's
mapping of the parameter it comes from (:mod:`megarl.sync.local_export`): ``dim`` 0 for column-parallel
layers (fused QKV and gate/up included: each HF part is split along its rows), 1 for row-parallel ones,
None for replicated ones; ``kv_heads`` for the K and V parts of a fused QKV; ``expert`` for a routed
expert's tensors.

The engine side follows SGLang's weight loaders (``sglang.srt.layers.linear``, ``vocab_parallel_embedding``,
``moe.fused_moe_triton.layer``) over the groups of the engine's :class:`~megarl.sync.engine_layout.EngineLayout`
(read from its resolved server arguments): a tensor of group ``g`` (:func:`engine_group`: attention, the
input embedding, the LM head, routed experts, the rest) split over ``parts`` ranks is loaded by rank ``i``
of them as chunk ``i`` of ``parts`` along the split dimension (``ColumnParallelLinear``,
``RowParallelLinear``, ``MergedColumnParallelLinear``, the Q part of ``QKVParallelLinear``;
``VocabParallelEmbedding`` / ``ParallelLMHead`` after padding the rows to a multiple of ``VOCAB_PADDING``,
times ``parts`` when that does not split evenly); K and V heads chunk ``i // replicas`` of ``parts /
replicas`` when there are fewer KV heads than attention ranks (``replicas = parts / kv_heads``); replicated
tensors, and any tensor of a group of one rank, whole; a routed expert only on the EP rank that owns it
(contiguous runs of ``experts / ep``), chunked over the MoE-TP ranks along its split
dimension. :func:`plan_transfers` intersects what every engine rank loads with what the trainer ranks
hold: a piece held by several ranks (replicated tensors, data-parallel copies) comes from one of them,
chosen so that the bytes spread over the holders. :class:`Piece` and :class:`Transfer` are the wire
format's (:mod:`megarl.wire.weight_shards`: the engine side reads them too).
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.sync.engine_layout import EngineLayout
from megarl.wire.weight_shards import Piece, Transfer

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
    """Engine rank ``tp_rank`` of an engine of ``layout``: its place in each group a weight is split over."""

    tp_rank: int
    layout: EngineLayout

    @property
    def ep_rank(self) -> int:
        """Its expert-parallel rank (SGLang's ``moe_ep_rank``)."""
        return self.tp_rank % (self.layout.tp // self.layout.moe_dp) // self.layout.moe_tp

    def position(self, group: str) -> tuple[int, int]:
        """(its index, the ranks) of the group a tensor of ``group`` (:func:`engine_group`) is split over."""
        layout = self.layout
        attention = (self.tp_rank % layout.attn_tp, layout.attn_tp)
        if group == "expert":
            return self.tp_rank % layout.moe_tp, layout.moe_tp
        if group in ("attention", "embedding") or (group == "head" and layout.dp_lm_head):
            return attention
        return self.tp_rank, layout.tp


def engine_group(name: str, split: Split) -> str:
    """The engine group HF tensor ``name`` is split over: ``expert`` (a routed expert), ``embedding`` (the
    input embedding), ``head`` (the LM head), ``attention`` (a ``self_attn`` weight) or ``tensor`` (the
    rest: all TP ranks). ValueError for a shared expert's: SGLang may fuse shared experts into the routed
    experts' kernel (``num_fused_shared_experts``, decided per model and GPU when the engine starts and not
    in ``/server_info``), which places them where this map cannot see."""
    if ".shared_expert" in name:
        raise ValueError(f"{name}: sharded resharding does not map shared experts (SGLang may fuse them into its "
                         "routed-expert kernel, a choice /server_info does not report); use sync.transport=distributed")
    if split.expert is not None:
        return "expert"
    if split.vocab:
        return "embedding" if "embed_tokens" in name else "head"
    return "attention" if ".self_attn." in name else "tensor"


def chunk(size: int, parts: int, index: int, pad_to: int = 1) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` of ``parts`` equal chunks of ``size`` rows padded to a multiple
    of ``pad_to`` (the padding rows are cut off: the last chunks may be short or empty)."""
    padded = -(-size // pad_to) * pad_to
    if padded % parts:
        raise ValueError(f"{size} rows (padded to {padded}) do not split into {parts} equal chunks")
    per = padded // parts
    return min(index * per, size), min((index + 1) * per, size)


def vocab_chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of the vocabulary rows rank ``index`` of ``parts`` loads (SGLang's
    ``VocabParallelEmbedding``: rows padded to ``VOCAB_PADDING``, or to ``VOCAB_PADDING * parts`` when that
    does not split into ``parts`` equal chunks)."""
    pad_to = VOCAB_PADDING if -(-size // VOCAB_PADDING) * VOCAB_PADDING % parts == 0 else VOCAB_PADDING * parts
    return chunk(size, parts, index, pad_to)


def engine_piece(name: str, dtype: str, shape: tuple[int, ...], split: Split, rank: EngineRank,
                 num_experts: int) -> Piece | None:
    """The part of HF tensor ``name`` that SGLang's loader of engine rank ``rank`` reads (None: none,
    a routed expert another EP rank owns)."""
    group = engine_group(name, split)
    index, parts = rank.position(group)
    if group == "expert" and split.expert // (num_experts // rank.layout.ep) != rank.ep_rank:
        return None
    if split.kv_heads and split.kv_heads < parts:
        replicas = parts // split.kv_heads
        parts, index = parts // replicas, index // replicas
    if split.dim is None or parts == 1:
        return Piece.whole(name, dtype, shape)
    start, stop = (vocab_chunk if split.vocab else chunk)(shape[split.dim], parts, index)
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
