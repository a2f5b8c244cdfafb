"""One trainer rank's part of a weight sync: gather -> pack -> hand to the transport, one bucket at a time.

Every rank of the trainer runs the same calls in the same order (the driver calls them on all
ranks through a :class:`megarl.sync.trainer_protocol.WeightSyncTrainer`, such as the trainer's
``TrainerGroup``): ``begin``, then ``next``/``send`` until
``next`` reports the end on every stage, then ``finish`` (or ``abort``). Every rank pulls its
stage's HF stream (the gathers are collectives); only the stage's sending rank packs buckets and
owns a transport :class:`~megarl.sync.transports.base.Sender`. The ``sharded`` transport has no
stage sender: every rank sends its own slices (:mod:`megarl.sync.sharded_rank`), and these calls hand
over to it. The ``tensor`` transport's buckets go from the stage senders to the ranks that feed the
colocated engines (:class:`~megarl.sync.transports.tensor.TensorFanout`, a round on every rank per
``send``), whose payloads ``send`` returns.

Memory bound on a sending rank: at most two buckets are alive (the one in transfer on the send
thread and the one being packed), plus at most one gathered tensor outside them (the one that did
not fit in the last bucket, or the look-ahead that tells whether it was the last);
``peak_bucket_bytes`` in the stats reports the largest sum of live bucket buffers. The buffer of a
sent bucket is reused by the next bucket packed (no fresh allocation and page faults per bucket)
or freed right after it; at the end of a sync the transport's sender gets the buffers back
(:meth:`~megarl.sync.transports.base.Sender.release`: host buffers are kept for the next sync of
the same link, device buffers freed).

Abort from another thread (the trainer actor runs :meth:`RankSync.abort` in a concurrency group of its
own): a call blocked on a transfer stuck on a lost peer (``send``/``finish`` waiting for the previous
bucket) sees the abort at once and raises (:mod:`megarl.sync.abort`); the abort then drops the sync and the links
once no other call of this rank runs (at most ``ABORT_WAIT_S``), so the next sync forms new links at
once while the stuck transfer's thread ends on its own, within the link's bound.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import asdict
from typing import Any

from megarl.sync.abort import wait_unless_aborted
from megarl.sync.buckets import Bucket, BucketIndex, BucketPacker
from megarl.sync.delta import DeltaEncoder, DeltaPlan, KeptWeights
from megarl.sync.errors import WeightSyncError
from megarl.sync.gather import is_stage_sender, pipeline_stage, stage_hf_stream
from megarl.sync.report import SenderStats
from megarl.sync.sharded_rank import ShardedRank
from megarl.sync.transports import Sender, SenderSpec, make_sender

log = logging.getLogger(__name__)

ABORT_WAIT_S = 10.0  # an abort waits this long for a running call that is not waiting on a transfer


def _exclusive(method):
    """Run ``method`` holding the rank's call lock (an abort from another thread waits for it)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._busy:
            return method(self, *args, **kwargs)
    return locked


class RankSync:
    """Weight-sync state of one trainer rank over its :class:`megarl.models.bridge.MegatronModel`."""

    def __init__(self, model):
        self.model = model
        self.stage = pipeline_stage()
        self.is_sender = is_stage_sender()
        self._address: dict | None = None
        self._senders: dict[str, Sender] = {}
        self._sender: Sender | None = None
        self._packer: BucketPacker | None = None
        self._ready: Bucket | None = None
        self._inflight: tuple[threading.Thread, Bucket, list] | None = None
        self._stats: SenderStats | None = None
        self._spare: list = []  # the buffer of the bucket sent last, for the next bucket to reuse
        self._kept = KeptWeights()  # delta mode: what this sender last sent (megarl.sync.delta)
        self._encoder: DeltaEncoder | None = None
        self._sharded: ShardedRank | None = None  # the sharded link: every rank takes part (sharded_rank.py)
        self._sharded_sync = False  # the running sync goes through it
        self._fanout = None  # the tensor link's route: every rank takes part (transports/tensor.py)
        self._fanout_sync = False  # the running sync goes through it
        self._busy = threading.Lock()  # held by every call but abort (_exclusive)
        self._aborting = threading.Event()  # set by abort: a call waiting for a transfer gives up

    # --- the link -------------------------------------------------------------------------------
    @_exclusive
    def address(self) -> dict | None:
        """Reserve a host/port for this stage's group (senders only; None elsewhere): the engines
        join at the sender's node address in a multi-node cluster, on loopback on one node."""
        if not self.is_sender:
            return None
        from megarl.parallel import free_port, rendezvous_host
        from megarl.sync.transports.distributed import link_backend

        host = rendezvous_host()
        self._address = {"stage": self.stage, "host": host, "port": free_port(host), "backend": link_backend()}
        return dict(self._address)

    @_exclusive
    def connect(self, spec: SenderSpec) -> None:
        """Build this rank's sender for ``spec.kind`` (replacing an older one); no-op off senders, except
        for ``sharded`` and ``tensor``, whose links every rank joins (collective)."""
        self._disconnect(spec.kind)
        if spec.kind == "sharded":
            self._sharded = ShardedRank(self.model, spec, self._aborting)
            return
        if self.is_sender:
            self._senders[spec.kind] = make_sender(spec, self.stage, self.model.bridge.hf_pretrained.config,
                                                   self._address)
        if spec.kind == "tensor":
            from megarl.sync.transports.tensor import TensorFanout

            self._fanout = TensorFanout(spec, self.stage, self.is_sender)

    @_exclusive
    def disconnect(self, kind: str) -> None:
        """Close this rank's ``kind`` link (no-op when it has none)."""
        self._disconnect(kind)

    def _disconnect(self, kind: str) -> None:
        if kind == "tensor" and self._fanout is not None:
            fanout, self._fanout = self._fanout, None
            fanout.close()
        if kind == "sharded":
            link, self._sharded = self._sharded, None
            if link is not None:
                link.close()
            return
        sender = self._senders.pop(kind, None)
        if sender is not None:
            sender.close()

    # --- one sync -------------------------------------------------------------------------------
    @_exclusive
    def begin(self, kind: str, version: int, capacity: int, delta: DeltaPlan | None = None) -> None:
        """Start a sync to ``version`` through ``kind`` with buckets of ``capacity`` bytes; with a
        ``delta`` plan, in delta mode (:mod:`megarl.sync.delta`)."""
        if self._packer is not None or self._sharded_sync:
            raise RuntimeError("a weight sync is already running on this rank (finish or abort it first)")
        if kind == "sharded":
            if self._sharded is None:
                raise RuntimeError("no sharded weight-sync link on this rank: connect first")
            self._sharded.begin(capacity, version, delta)
            self._sharded_sync = True
            return
        if kind == "tensor" and self._fanout is None:
            raise RuntimeError("no 'tensor' weight-sync link on this rank: connect first")
        self._fanout_sync = kind == "tensor"
        sender = None
        if self.is_sender:
            sender = self._senders.get(kind)
            if sender is None:
                raise RuntimeError(f"no {kind!r} weight-sync link on this rank: connect first")
            sender.begin(version)
        self._sender = sender
        self._stats = SenderStats(stage=self.stage, capacity=capacity)
        kwargs = {"allocate": self._allocate, "adopt": sender.adopt} if sender is not None else {}
        if sender is not None and delta is not None:
            self._encoder = DeltaEncoder(self._kept, delta, version)
            kwargs["adopt"] = lambda tensor: None  # the encoded bucket is written over its own buffer
        self._packer = BucketPacker(stage_hf_stream(self.model), capacity, self.stage, keep=sender is not None,
                                    **kwargs)

    def _allocate(self, nbytes: int):
        """A bucket buffer: a sent bucket's buffer of the same size, else a new one from the transport."""
        for i, buffer in enumerate(self._spare):
            if buffer.numel() == nbytes:
                return self._spare.pop(i)
        return self._sender.allocate(nbytes)

    @_exclusive
    def next(self) -> BucketIndex | None:
        """Gather and pack this stage's next bucket; its index on the sender, None elsewhere or at the end."""
        if self._sharded_sync:
            return self._sharded.next()
        if self._packer is None:
            raise RuntimeError("no weight sync running on this rank: begin first")
        if self._ready is not None:
            raise RuntimeError(f"bucket {self._ready.index.seq} was packed but never sent")
        item = self._packer.next_bucket()
        unused, self._spare = self._spare, []  # a sent bucket's buffer that this bucket did not reuse
        if self._sender is None or item is None:
            if self._sender is not None:
                self._sender.release(unused)
            return None
        if self._encoder is not None:
            item = self._encoder.encode(item)
        self._ready = item
        alive = item.held_bytes + (self._inflight[1].held_bytes if self._inflight else 0)
        self._stats.peak_bucket_bytes = max(self._stats.peak_bucket_bytes, alive)
        self._stats.bytes += item.index.nbytes
        self._stats.buckets += 1
        return item.index

    @_exclusive
    def send(self) -> Any:
        """Start the transfer of the bucket ``next`` packed (after the previous one finished and
        was freed); returns the transport's payload for the driver (None off senders, and on a sender
        whose stage has sent its last bucket while other stages still send theirs). Through the ``tensor``
        route every rank takes part and returns the payloads it made (:meth:`TensorFanout.round`)."""
        if self._sharded_sync:
            return self._sharded.send()
        started = self._start_transfer()
        if self._fanout_sync:
            return self._fanout.round(started[0] if started is not None else None)
        return None if started is None else started[1]

    def _start_transfer(self) -> tuple[Bucket, Any] | None:
        """The bucket ``next`` packed and its payload, its transfer started on the send thread; None on a rank
        with nothing to send this round."""
        if self._sender is None or (self._ready is None and self._packer is not None and self._packer.exhausted):
            return None
        self._join()
        if self._ready is None:
            raise RuntimeError("no packed bucket to send: call next first")
        bucket, self._ready = self._ready, None
        payload = self._sender.prepare(bucket)
        errors: list = []
        thread = threading.Thread(target=_transfer, args=(self._sender, self._stats, bucket, errors),
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
        if not wait_unless_aborted(thread, self._aborting):
            raise WeightSyncError(f"weight sync aborted during the transfer of bucket {bucket.index.seq} "
                                  f"on stage {self.stage}")
        self._inflight = None
        if bucket.allocation is not None and bucket.allocation.numel() == self._stats.capacity and not errors:
            self._spare.append(bucket.allocation)
        del bucket
        if errors:
            raise WeightSyncError(f"weight-sync transfer failed on stage {self.stage}: {errors[0]}") from errors[0]

    @_exclusive
    def finish(self) -> dict | None:
        """Wait for the last transfer and end the sync; the sender's :class:`SenderStats` as a dict."""
        if self._sharded_sync:
            self._sharded_sync = False
            return self._sharded.finish()
        try:
            self._join()
            if self._ready is not None or (self._packer is not None and self._packer.next_bucket() is not None):
                raise RuntimeError("weight sync finished before every bucket was sent")
            if self._sender is not None:
                self._sender.release(self._spare)
            if self._fanout_sync:
                self._fanout.finish()
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
        return asdict(stats) if self.is_sender and stats is not None else None

    def abort(self) -> None:
        """Drop the running sync and close the links (a failed transfer leaves them unusable); safe
        from another thread while a call of this rank runs.

        Returns at once: a call waiting for a transfer gives up (it raises WeightSyncError), and a
        transfer still in progress is left to its thread, which the transport bounds
        (``sync.timeout_s``); its bucket stays alive until then. WeightSyncError when another running
        call does not return within ``ABORT_WAIT_S``."""
        self._aborting.set()
        try:
            if not self._busy.acquire(timeout=ABORT_WAIT_S):
                raise WeightSyncError(f"weight-sync abort on stage {self.stage}: a call of this rank still runs "
                                      f"after {ABORT_WAIT_S:g} s")
            try:
                self._drop()
            finally:
                self._busy.release()
        finally:
            self._aborting.clear()

    def _drop(self) -> None:
        if self._inflight is not None and self._inflight[0].is_alive():
            log.warning("weight sync aborted during the transfer of a bucket on stage %d; its thread ends "
                        "within the link's timeout", self.stage)
            self._inflight = None
        try:
            self._join()
            if self._sharded_sync:
                self._sharded.abort()
        except WeightSyncError as e:
            log.warning("weight sync aborted after a failed transfer: %s", e)
        finally:
            self._sharded_sync = False
            self._reset()
            for kind in [*self._senders, "sharded", "tensor"]:
                self._disconnect(kind)

    def _reset(self) -> None:
        self._fanout_sync = False
        self._packer = None
        self._ready = None
        self._inflight = None
        self._sender = None
        self._stats = None
        self._spare = []
        self._encoder = None


def _transfer(sender: Sender, stats: SenderStats, bucket: Bucket, errors: list) -> None:
    """The send thread: ``sender`` moves ``bucket``; an error goes to ``errors`` (re-raised on the rank's
    main thread by ``RankSync._join``). Holds its own references: an aborted sync may leave it running."""
    t0 = time.perf_counter()
    try:
        sender.transfer(bucket)
    except BaseException as e:
        errors.append(e)
    finally:
        stats.send_s += time.perf_counter() - t0
