"""The interface every weight transport implements, in two halves, and the stage path's sender.

- A trainer rank's half is a :class:`megarl.sync.link.RankLink`, made on every rank from the transport's
  :class:`LinkSpec` (one spec class a transport, with that transport's fields). A transport that sends
  from one rank per pipeline stage implements only a :class:`Sender` and runs the stage path
  (:class:`megarl.sync.stage_link.StageLink`); one that does not fit it is a link class of its own.
- :class:`Sender` lives on a trainer rank that sends (one per pipeline stage). For every bucket
  it gets ``prepare`` (quick, on the calling thread: returns the JSON-able payload the driver
  forwards to the engines, e.g. a file name; the ``tensor`` route's ranks make theirs) and then ``transfer``
  (the bulk move, on the rank's send thread, overlapping the gather of the next bucket).
  ``allocate`` gives bucket buffers: one kept from the last sync, else the transport's ``new_buffer``
  (device, shared memory).
- :class:`EngineSide` lives in the driver: it joins the engines to the link (``connect``), takes each
  bucket's payload from what the ranks returned (``payload``), makes each engine load each bucket
  (``load``, concurrent with the sender's ``transfer``) and finishes a sync (``commit``). The sync's
  last weight-load call to each engine also carries a :class:`Finish` (the new weight version, and the
  cache flush): the last bucket's ``load`` when engines load per bucket, else ``commit``. The protocol
  around it (pause, begin/end weight update, failures) is :class:`megarl.sync.weight_sync.WeightSync`'s,
  not the transport's.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from megarl.sync.buckets import Bucket, BucketIndex


@dataclass(frozen=True)
class LinkSpec:
    """What every trainer rank needs to make its half of one transport's link (pickled to the ranks): one
    subclass a transport, named by its ``kind`` (the transport's name), with that transport's fields."""

    kind: ClassVar[str]


@dataclass(frozen=True)
class Finish:
    """What the last weight-load call of a sync carries to SGLang: ``weight_version`` becomes the
    engine's version label, and with ``flush_cache`` the engine drops the KV/radix cache computed
    by the old weights in the same call (SGLang's ``weight_version`` and ``flush_cache`` fields of
    its update requests)."""

    weight_version: int
    flush_cache: bool


def finish_fields(finish: Finish | None) -> dict:
    """The client keyword arguments of a load call carrying ``finish``; without one (every
    earlier load) the version label stays and nothing is flushed."""
    if finish is None:
        return {"weight_version": None, "flush_cache": False}
    return {"weight_version": finish.weight_version, "flush_cache": finish.flush_cache}


@dataclass
class KeptBuffers:
    """Host bucket buffers a sender keeps from one sync to the next (at most ``limit``, the two a
    sync has alive): a new host buffer costs a page fault per 4 KiB when first written.
    Device buffers are not kept: the training step needs that memory."""

    limit: int = 2
    buffers: list[torch.Tensor] = field(default_factory=list)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A kept buffer of exactly ``nbytes``, removed from the kept ones, or None."""
        for i, buffer in enumerate(self.buffers):
            if buffer.numel() == nbytes:
                return self.buffers.pop(i)
        return None

    def keep(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = (self.buffers + [b for b in buffers if b.device.type == "cpu"])[-self.limit:]


class Sender(abc.ABC):
    """Trainer-rank half of a transport (see the module docstring). Subclasses call
    ``super().__init__()`` and ``super().close()``."""

    def __init__(self) -> None:
        self._kept = KeptBuffers()  # host bucket buffers of earlier syncs

    def begin(self, version: int) -> None:
        """A sync to ``version`` starts (before its first bucket)."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 buffer of ``nbytes`` for one bucket: one kept from an earlier sync when its
        size fits, else :meth:`new_buffer`."""
        kept = self._kept.take(nbytes)
        return kept if kept is not None else self.new_buffer(nbytes)

    @abc.abstractmethod
    def new_buffer(self, nbytes: int) -> torch.Tensor:
        """A new 1-D uint8 buffer of ``nbytes`` where the transport wants it (device, shared memory)."""

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A uint8 view of ``tensor`` to send as a bucket buffer without copying it (used for
        tensors larger than a bucket), or None when buffers must come from :meth:`allocate`."""
        if not tensor.is_contiguous():
            return None
        return tensor.detach().reshape(-1).view(torch.uint8)

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Buffers from :meth:`allocate` that the sync no longer uses (at its end): host ones are
        kept for the next sync (:class:`KeptBuffers`), device ones dropped."""
        self._kept.keep(buffers)

    @abc.abstractmethod
    def prepare(self, bucket: Bucket) -> Any:
        """The payload the driver passes to :meth:`EngineSide.load` for this bucket (JSON-able or None)."""

    @abc.abstractmethod
    def transfer(self, bucket: Bucket) -> None:
        """Move the bucket's bytes (blocking; runs on the send thread)."""

    def close(self) -> None:
        """Release the link and the kept buffers (idempotent)."""
        self._kept = KeptBuffers()


class EngineSide(abc.ABC):
    """Driver half of a transport (see the module docstring)."""

    name: str
    loads_per_bucket = True  # engines change weights from the first bucket on (disk: only at commit)

    @abc.abstractmethod
    def link_spec(self, num_engines: int) -> LinkSpec:
        """The spec every trainer rank gets to make its half of the link for ``num_engines`` engines."""

    async def connect(self, trainer, engines: list) -> None:
        """Join ``engines`` (SGLangClients) and the trainer's ranks to the link (by default the ranks
        only make their half: nothing to join on the engines). ``trainer`` is a
        :class:`megarl.sync.trainer_protocol.WeightSyncTrainer`."""
        await trainer.weight_sync_connect(self.link_spec(len(engines)))

    async def disconnect(self, trainer, engines: list) -> None:
        """Tear the link down on both sides (best effort: engines may be dead)."""
        await trainer.weight_sync_disconnect(self.name)

    def before_sync(self, version: int) -> None:
        """Called in the driver before the senders begin a sync to ``version``."""

    def payload(self, rank: int, index: BucketIndex, sent: list) -> Any:
        """The payload of bucket ``index``, sent by trainer rank ``rank``, from every rank's ``weight_sync_send``
        result (``sent``, by rank): by default that rank's own."""
        return sent[rank]

    @abc.abstractmethod
    async def load(self, engines: list, index: BucketIndex, payload: Any, finish: Finish | None = None) -> None:
        """Make every engine load one bucket (the sender's transfer runs meanwhile); ``finish``
        rides on the sync's last bucket when ``loads_per_bucket``."""

    async def commit(self, engines: list, version: int, indices: list[BucketIndex], payloads: list,
                     finish: Finish | None = None) -> None:
        """After the last bucket: what the transport still needs to do before the session ends;
        ``finish`` rides on this call's load when not ``loads_per_bucket``."""
