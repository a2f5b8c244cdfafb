"""The stage path of a weight sync on one trainer rank: gather -> pack -> hand to the transport's sender.

Every rank pulls its pipeline stage's HF stream (the gathers are collectives of the stage's TP and EP
groups); only the stage's sending rank packs buckets and owns a transport
:class:`~megarl.sync.transports.base.Sender` (``distributed``, ``disk``; ``tensor`` through
:class:`megarl.sync.transports.tensor.TensorLink`, this path plus a fan-out of each bucket).

Memory bound on a sending rank: at most two buckets are alive (the one in transfer on the send
thread and the one being packed), plus at most one gathered tensor outside them (the one that did
not fit in the last bucket, or the look-ahead that tells whether it was the last);
``peak_bucket_bytes`` in the stats reports the largest sum of live bucket buffers. The buffer of a
sent bucket is reused by the next bucket packed (no fresh allocation and page faults per bucket)
or freed right after it; at the end of a sync the transport's sender gets the buffers back
(:meth:`~megarl.sync.transports.base.Sender.release`: host buffers are kept for the next sync of
the same link, device buffers freed).

Delta mode (:mod:`megarl.sync.delta`): the sending rank keeps a host copy of what it last sent through
this link and re-encodes each packed bucket against it.

A call blocked on a transfer stuck on a lost peer (``send``/``finish`` waiting for the previous bucket)
sees the rank's abort at once and raises (:mod:`megarl.sync.abort`); the stuck transfer's thread ends on its
own, within the link's bound.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from megarl.sync.abort import wait_unless_aborted
from megarl.sync.buckets import Bucket, BucketIndex, BucketPacker
from megarl.sync.delta import DeltaEncoder, DeltaPlan, KeptWeights
from megarl.sync.errors import WeightSyncError
from megarl.sync.gather import stage_hf_stream
from megarl.sync.link import RankContext, RankLink
from megarl.sync.report import SenderStats
from megarl.sync.transports.base import Sender

log = logging.getLogger(__name__)


class StageLink(RankLink):
    """The stage path over one transport: ``make_sender()`` builds the sending rank's
    :class:`~megarl.sync.transports.base.Sender` (only there: the other ranks gather and drop)."""

    def __init__(self, rank: RankContext, make_sender: Callable[[], Sender]):
        self.rank = rank
        self.sender: Sender | None = make_sender() if rank.is_sender else None
        self._packer: BucketPacker | None = None
        self._ready: Bucket | None = None
        self._inflight: tuple[threading.Thread, Bucket, list] | None = None
        self._stats: SenderStats | None = None
        self._spare: list = []  # the buffer of the bucket sent last, for the next bucket to reuse
        self._kept = KeptWeights()  # delta mode: what this sender last sent (megarl.sync.delta)
        self._encoder: DeltaEncoder | None = None

    def begin(self, version: int, capacity: int, delta: DeltaPlan | None) -> None:
        sender = self.sender
        if sender is not None:
            sender.begin(version)
        self._stats = SenderStats(stage=self.rank.stage, capacity=capacity)
        kwargs = {"allocate": self._allocate, "adopt": sender.adopt} if sender is not None else {}
        if sender is not None and delta is not None:
            self._encoder = DeltaEncoder(self._kept, delta, version)
            kwargs["adopt"] = lambda tensor: None  # the encoded bucket is written over its own buffer
        self._packer = BucketPacker(stage_hf_stream(self.rank.model), capacity, self.rank.stage,
                                    keep=sender is not None, **kwargs)

    def _allocate(self, nbytes: int):
        """A bucket buffer: a sent bucket's buffer of the same size, else a new one from the transport."""
        for i, buffer in enumerate(self._spare):
            if buffer.numel() == nbytes:
                return self._spare.pop(i)
        return self.sender.allocate(nbytes)

    def next(self) -> BucketIndex | None:
        """Gather and pack this stage's next bucket; its index on the sender, None elsewhere or at the end."""
        if self._packer is None:
            raise RuntimeError("no weight sync running on this rank: begin first")
        if self._ready is not None:
            raise RuntimeError(f"bucket {self._ready.index.seq} was packed but never sent")
        item = self._packer.next_bucket()
        unused, self._spare = self._spare, []  # a sent bucket's buffer that this bucket did not reuse
        if self.sender is None or item is None:
            if self.sender is not None:
                self.sender.release(unused)
            return None
        if self._encoder is not None:
            item = self._encoder.encode(item)
        self._ready = item
        alive = item.held_bytes + (self._inflight[1].held_bytes if self._inflight else 0)
        self._stats.peak_bucket_bytes = max(self._stats.peak_bucket_bytes, alive)
        self._stats.bytes += item.index.nbytes
        self._stats.buckets += 1
        return item.index

    def send(self) -> Any:
        """Start the transfer of the bucket ``next`` packed (after the previous one finished and was freed);
        the transport's payload for the driver (None off senders, and on a sender whose stage has sent its
        last bucket while other stages still send theirs)."""
        started = self.start_transfer()
        return None if started is None else started[1]

    def start_transfer(self) -> tuple[Bucket, Any] | None:
        """The bucket ``next`` packed and its payload (:meth:`Sender.prepare`), its transfer started on the
        send thread; None on a rank with nothing to send this round."""
        if self.sender is None or (self._ready is None and self._packer is not None and self._packer.exhausted):
            return None
        self._join()
        if self._ready is None:
            raise RuntimeError("no packed bucket to send: call next first")
        bucket, self._ready = self._ready, None
        payload = self.sender.prepare(bucket)
        errors: list = []
        thread = threading.Thread(target=_transfer, args=(self.sender, self._stats, bucket, errors),
                                  name="weight-sync-send", daemon=True)
        self._inflight = (thread, bucket, errors)
        thread.start()
        return bucket, payload

    def _join(self) -> None:
        """Wait for the bucket in transfer; WeightSyncError when it failed or an abort came meanwhile
        (the transfer is then left to its thread)."""
        if self._inflight is None:
            return
        thread, bucket, errors = self._inflight
        if not wait_unless_aborted(thread, self.rank.aborting):
            raise WeightSyncError(f"weight sync aborted during the transfer of bucket {bucket.index.seq} "
                                  f"on stage {self.rank.stage}")
        self._inflight = None
        if bucket.allocation is not None and bucket.allocation.numel() == self._stats.capacity and not errors:
            self._spare.append(bucket.allocation)
        del bucket
        if errors:
            raise WeightSyncError(f"weight-sync transfer failed on stage {self.rank.stage}: {errors[0]}") \
                from errors[0]

    def finish(self) -> SenderStats | None:
        """Wait for the last transfer and end the sync; the sender's :class:`SenderStats`."""
        try:
            self._join()
            if self._ready is not None or (self._packer is not None and self._packer.next_bucket() is not None):
                raise RuntimeError("weight sync finished before every bucket was sent")
            if self.sender is not None:
                self.sender.release(self._spare)
            stats = self._stats
            if stats is not None:
                stats.tensors = self._packer.stats.tensors
                stats.gather_s = self._packer.stats.gather_s
                stats.convert_s = self._packer.stats.convert_s
                stats.largest_tensor_bytes = self._packer.stats.largest_tensor_bytes
            if self._encoder is not None:
                self._encoder.finish()
                stats.delta = self._encoder.delta
                stats.elements = self._encoder.stats.elements
                stats.changed_elements = self._encoder.stats.changed
                stats.dense_bytes = self._encoder.stats.dense_bytes
        finally:
            self._reset()
        return stats if self.rank.is_sender else None

    def abort(self) -> None:
        if self._inflight is not None and self._inflight[0].is_alive():
            log.warning("weight sync aborted during the transfer of a bucket on stage %d; its thread ends "
                        "within the link's timeout", self.rank.stage)
            self._inflight = None
        try:
            self._join()
        finally:
            self._reset()

    def _reset(self) -> None:
        self._packer = None
        self._ready = None
        self._inflight = None
        self._stats = None
        self._spare = []
        self._encoder = None

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def _transfer(sender: Sender, stats: SenderStats, bucket: Bucket, errors: list) -> None:
    """The send thread: ``sender`` moves ``bucket``; an error goes to ``errors`` (re-raised on the rank's
    main thread by ``StageLink._join``). Holds its own references: an aborted sync may leave it running."""
    t0 = time.perf_counter()
    try:
        sender.transfer(bucket)
    except BaseException as e:
        errors.append(e)
    finally:
        stats.send_s += time.perf_counter() - t0
