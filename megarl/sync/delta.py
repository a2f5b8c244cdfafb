"""The sending rank's half of a delta sync: what it last sent, and each bucket re-encoded against it.

With ``sync.delta`` on, every sync of a link runs in delta mode (:class:`DeltaPlan`). The driver
names the version the engines' baseline holds (``base``; None when unknown: an engine started,
restarted or recovered, or the last sync failed); when the sender's kept copy is of that version the
bucket's tensors travel as their changed elements (:mod:`megarl.wire.weight_delta`), otherwise (a
full sync, or a version gap: the engines do not hold the trainer's previous version) whole. Either
way the engines record what they load as their next baseline, and the sender refreshes its copy.

Memory: :class:`KeptWeights` holds the stage's HF tensors as last sent, in the export dtype
(``model.dtype``), in host memory: one copy of the stage's share of the model (the whole model's
bytes over the pipeline stages, per sending rank), plus per bucket the encoded pieces (at most the
bucket's bytes) while it is rewritten. On a GPU the comparison copies each kept tensor to the device
(host-to-device traffic of the stage's model bytes per sync); the encoded bucket is written over the
packed one, in the same buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.sync.buckets import DTYPE_NAMES, Bucket, BucketIndex, TensorEntry
from megarl.wire.weight_delta import INDICES, VALUES, aligned_order, changed_mask, choose, encode, largest_gap


@dataclass(frozen=True)
class DeltaPlan:
    """A delta-mode sync: ``base``, the version whose weights every engine holds as its baseline (None:
    unknown, send whole); a bucket whose delta exceeds ``max_fraction`` of its bytes travels whole."""

    base: int | None
    max_fraction: float


@dataclass
class KeptWeights:
    """HF name -> host copy (export dtype) of what this sender last sent; ``version``: the sync that
    sent it all, None while a sync runs or after one failed."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int | None = None

    def keep(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Refresh the copy of ``name`` with ``tensor``; returns the copy."""
        held = self.tensors.get(name)
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
            held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self.tensors[name] = held
        held.copy_(tensor)
        return held


@dataclass
class DeltaStats:
    """What the encoded buckets of one sync carried: elements and changed elements of every tensor,
    and the bytes the buckets would have had whole."""

    elements: int = 0
    changed: int = 0
    dense_bytes: int = 0


class DeltaEncoder:
    """Re-encodes the buckets of one sync to ``version`` against ``kept`` (see the module docstring);
    :meth:`finish` marks the kept copy as ``version``'s once every bucket went."""

    def __init__(self, kept: KeptWeights, plan: DeltaPlan, version: int):
        self.kept = kept
        self.plan = plan
        self.version = version
        self.delta = plan.base is not None and plan.base == kept.version
        self.stats = DeltaStats()
        kept.version = None  # partly refreshed until finish

    def encode(self, bucket: Bucket) -> Bucket:
        """``bucket`` (whole tensors, in a buffer of its own) as it travels: its pieces written over
        its buffer, or whole (marked as a delta-mode bucket either way)."""
        views = bucket.views()
        self.stats.dense_bytes += bucket.index.nbytes
        self.stats.elements += sum(t.numel() for _, t in views)
        if not self.delta:
            for name, tensor in views:
                self.kept.keep(name, tensor)
            self.stats.changed += sum(t.numel() for _, t in views)
            return _marked(bucket, bucket.index.entries, bucket.index.nbytes)
        pieces = self._pieces(views)
        nbytes = sum(t.numel() * t.element_size() for _, t in pieces)
        if nbytes > self.plan.max_fraction * bucket.index.nbytes:
            for name, tensor in views:
                self.kept.keep(name, tensor)
            return _marked(bucket, bucket.index.entries, bucket.index.nbytes)
        entries, offset = [], 0
        for name, tensor in aligned_order(pieces):
            n = tensor.numel() * tensor.element_size()
            bucket.buffer[offset: offset + n].view(tensor.dtype).copy_(tensor.reshape(-1))
            entries.append(TensorEntry(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), offset))
            offset += n
        return _marked(bucket, tuple(entries), offset)

    def _pieces(self, views: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The encoded pieces of ``views``, the kept copies refreshed; at least one piece (a bucket
        with no change re-sends one element: an engine load needs a non-empty bucket)."""
        pieces = []
        for name, new in views:
            changed, encoded = changed_pieces(name, new, self.kept.tensors.get(name))
            self.stats.changed += changed
            held = self.kept.keep(name, new)
            pieces += [(name, held)] if encoded is None else encoded  # dense: the copy, not the buffer's view
        if not pieces:
            name, new = views[0]
            pieces = [(name + INDICES, torch.zeros(1, dtype=torch.int32)), (name + VALUES, new.reshape(-1)[:1].clone())]
        return pieces

    def finish(self) -> None:
        self.kept.version = self.version


def changed_pieces(name: str, new: torch.Tensor, old: torch.Tensor | None) -> tuple[int, list | None]:
    """The elements of ``new`` that differ from ``old`` (None, or another shape or dtype: all of them) and
    their smallest encoding under ``name`` (:func:`megarl.wire.weight_delta.choose`): (changed count,
    (piece name, tensor) pieces: [] when nothing changed, None when ``new`` travels whole)."""
    mask = (torch.ones(new.numel(), dtype=torch.bool, device=new.device)
            if old is None or old.shape != new.shape or old.dtype != new.dtype else changed_mask(new, old))
    changed = int(mask.sum())
    if not changed:
        return 0, []
    kind = choose(new.numel(), changed, new.element_size(), largest_gap(mask))
    return changed, None if kind == "dense" else encode(name, new, mask, kind)


def _marked(bucket: Bucket, entries: tuple[TensorEntry, ...], nbytes: int) -> Bucket:
    index = BucketIndex(bucket.index.stage, bucket.index.seq, entries, nbytes, bucket.index.last, delta=True)
    return Bucket(index, bucket.buffer[:nbytes], bucket.held_bytes, bucket.allocation)
