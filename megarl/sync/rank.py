"""One trainer rank's part of a weight sync: its links, one per transport, and the sync running through one.

Every rank of the trainer runs the same calls in the same order (the driver calls them on all ranks
through a :class:`megarl.sync.trainer_protocol.WeightSyncTrainer`, such as the trainer's
``TrainerGroup``): ``connect`` makes this rank's half of a transport's link from its spec
(:data:`megarl.sync.transports.REGISTRY` names the transport's :class:`~megarl.sync.link.RankLink`); a sync is
``begin``, then ``next``/``send`` until ``next`` reports the end on every stage, then ``finish`` (or
``abort``), each handed to the link the sync runs through (:mod:`megarl.sync.link` lists the sync modes).

Abort from another thread (the trainer actor runs :meth:`RankSync.abort` in a concurrency group of its
own): a call blocked on a transfer stuck on a lost peer sees the abort at once and raises
(:mod:`megarl.sync.abort`); the abort then drops the sync and the links once no other call of this rank
runs (at most ``ABORT_WAIT_S``), so the next sync forms new links at once while the stuck transfer's
thread ends on its own, within the link's bound.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from megarl.sync.buckets import BucketIndex
from megarl.sync.delta import DeltaPlan
from megarl.sync.errors import WeightSyncError
from megarl.sync.gather import is_stage_sender, pipeline_stage
from megarl.sync.link import RankContext, RankLink
from megarl.sync.report import SenderStats
from megarl.sync.transports import LinkSpec, make_link

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
        self._links: dict[str, RankLink] = {}  # transport name -> this rank's half of its link
        self._running: RankLink | None = None  # the link the running sync goes through
        self._busy = threading.Lock()  # held by every call but abort (_exclusive)
        self._aborting = threading.Event()  # set by abort: a call waiting for a transfer gives up

    # --- the links ------------------------------------------------------------------------------
    @_exclusive
    def address(self) -> dict | None:
        """Reserve a host/port for this stage's group (senders only; None elsewhere): the engines
        join at the sender's node address in a multi-node cluster, on loopback on one node."""
        if not self.is_sender:
            return None
        from megarl.parallel import free_port, rendezvous_host
        from megarl.sync.transports.groups import link_backend

        host = rendezvous_host()
        self._address = {"stage": self.stage, "host": host, "port": free_port(host), "backend": link_backend()}
        return dict(self._address)

    @_exclusive
    def connect(self, spec: LinkSpec) -> None:
        """Make this rank's half of ``spec.kind``'s link (replacing an older one); collective where the
        transport's link is (every rank calls it)."""
        self._disconnect(spec.kind)
        context = RankContext(self.model, self.stage, self.is_sender, self._address, self._aborting)
        self._links[spec.kind] = make_link(spec, context)

    @_exclusive
    def disconnect(self, kind: str) -> None:
        """Close this rank's ``kind`` link (no-op when it has none)."""
        self._disconnect(kind)

    def _disconnect(self, kind: str) -> None:
        link = self._links.pop(kind, None)
        if link is not None:
            link.close()

    # --- one sync -------------------------------------------------------------------------------
    @_exclusive
    def begin(self, kind: str, version: int, capacity: int, delta: DeltaPlan | None = None) -> None:
        """Start a sync to ``version`` through ``kind`` with buckets of ``capacity`` bytes; with a
        ``delta`` plan, in delta mode (:mod:`megarl.sync.delta`)."""
        if self._running is not None:
            raise RuntimeError("a weight sync is already running on this rank (finish or abort it first)")
        link = self._links.get(kind)
        if link is None:
            raise RuntimeError(f"no {kind!r} weight-sync link on this rank: connect first")
        link.begin(version, capacity, delta)
        self._running = link

    def _sync(self) -> RankLink:
        if self._running is None:
            raise RuntimeError("no weight sync running on this rank: begin first")
        return self._running

    @_exclusive
    def next(self) -> BucketIndex | None:
        """The running sync's next bucket (:meth:`RankLink.next`): its index on the rank that reports it."""
        return self._sync().next()

    @_exclusive
    def send(self) -> Any:
        """Start the transfer of the bucket ``next`` prepared; the transport's payload for the driver
        (:meth:`RankLink.send`)."""
        return self._sync().send()

    @_exclusive
    def finish(self) -> SenderStats | None:
        """Wait for the last transfer and end the sync; this rank's :class:`SenderStats` where it sends."""
        link, self._running = self._sync(), None
        return link.finish()

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
        link, self._running = self._running, None
        try:
            if link is not None:
                link.abort()
        except WeightSyncError as e:
            log.warning("weight sync aborted after a failed transfer: %s", e)
        finally:
            for kind in list(self._links):
                self._disconnect(kind)
