"""The weight-sync protocol between the trainer and the engines, driven from the async driver.

One sync to version ``v``, four control round trips per engine around the buckets: pause generation
(mode given by the caller) then ``begin_weight_update`` on every engine, while every trainer stage
gathers, packs and starts sending its first bucket (the engines end the forward they are running
first) -> the buckets (every trainer stage gathers and packs its next bucket while the engines load
the previous one; the sync's last load call, the final bucket's or the disk transport's checkpoint
load, also sets the engines' ``weight_version`` to ``v`` and flushes the KV/radix cache the old
weights computed, except for ``in_place`` pauses, whose frozen requests still hold their cache) ->
``end_weight_update`` -> continue generation. Nothing runs on an engine between its pause and its
continue, so the version and the flush riding on the last load are the same as separate calls after
``end_weight_update``.

Delta mode (``sync.delta``, :mod:`megarl.sync.delta`): a sync sends only the elements that changed
when every engine holds, as its baseline, the version the trainer's senders sent last; otherwise
(the first sync of this object: an engine (re)started; after a failed sync, a recovery, or a version
gap) it sends the weights whole, marked so that the engines record them as their next baseline.

Failure (an engine error, a dead engine, a trainer error, or the sync running past
``timeout_s``): the trainer drops its buckets and links; engines that received no bucket end their
update session and resume on their previous weights and version; engines that may hold part of
the new weights stay paused (they never serve a request in that state) and leave the set of
synced engines, and so do engines that failed; :class:`WeightSyncError` names both groups.
:meth:`WeightSync.recover` brings such an engine (or a restarted one at the same URL, or a new
one) to the current version through a disk checkpoint and returns it to the set; the next
:meth:`WeightSync.update` forms the link again with the engines then in the set.

Never hang: ``timeout_s`` bounds :meth:`WeightSync.setup` and each sync as a whole, and below them
every group formation and every bucket's collective on both sides of the link (the trainer's
senders, the engines' joins and receives: :mod:`megarl.sync.transports.distributed`,
:mod:`megarl.engine_process.update_group`), so no process waits past it for a peer that is gone; the
failure path then returns within a few seconds (the trainer's abort leaves a stuck transfer to its
bounded thread, the engines are probed at once), so the driver's :class:`WeightSyncError` comes about
``timeout_s`` after a peer is lost. An engine it lists as failed (unreachable, dead) is out of the
synced set until :meth:`WeightSync.recover`, which also closes the update session the lost sync left
open on it.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from megarl.engines.types import PauseMode
from megarl.sync.buckets import BucketIndex
from megarl.sync.delta import DeltaPlan
from megarl.sync.errors import WeightSyncError, past_bound
from megarl.sync.report import SenderStats, SyncReport
from megarl.sync.settings import SyncSettings
from megarl.sync.trainer_protocol import WeightSyncTrainer
from megarl.sync.transports import make_engine_side
from megarl.sync.transports.base import EngineSide, Finish
from megarl.sync.transports.disk import DiskEngineSide

log = logging.getLogger(__name__)

CLEANUP_TIMEOUT_S = 30.0  # per engine call on the failure path (a dead engine answers at once)
PROBE_TIMEOUT_S = 3.0  # the failure path's liveness probe of an engine (/model_info, no scheduler work)


@dataclass
class _Progress:
    """How far a sync got, per engine position: update session begun, bucket loads started."""

    began: set[int] = field(default_factory=set)
    touched: set[int] = field(default_factory=set)


class WeightSync:
    """Moves the trainer's weights into SGLang engines.

    ``trainer`` is a :class:`megarl.trainer.actor.TrainerGroup` (anything implementing
    :class:`megarl.sync.trainer_protocol.WeightSyncTrainer`); ``engines`` are
    :class:`megarl.engines.client.SGLangClient` of engines
    that serve the trainer's current weights at version ``initial_version``. Calls must not
    overlap (an internal lock serialises them).
    """

    def __init__(self, settings: SyncSettings, trainer: WeightSyncTrainer, engines: list, initial_version: int = 0):
        self.settings = settings
        self.trainer = trainer
        self.engines = list(engines)
        self.version = initial_version  # the trainer's weights as of the last update() call
        self._transport = make_engine_side(self.settings)
        # recovery goes through disk; with the disk transport, through the same side (one link)
        self._disk = (self._transport if isinstance(self._transport, DiskEngineSide)
                      else DiskEngineSide(self.settings.work_dir))
        self._linked: set[str] = set()  # transports whose link is formed with the current engines
        self._engine_base: int | None = None  # delta mode: the version every engine holds as its baseline
        self._open_sessions: set[str] = set()  # URLs of failed engines whose update session may still be open
        self._lock = asyncio.Lock()

    # --- public API ---------------------------------------------------------------------------------
    async def setup(self) -> None:
        """Form the link between the trainer's sending ranks and the engines; WeightSyncError when
        it does not form within ``timeout_s`` (the trainer's half of it is dropped)."""
        async with self._lock:
            try:
                await self._connect(self._transport, self.engines)
            except Exception as e:
                await _quietly(self.trainer.weight_sync_abort())
                raise WeightSyncError(f"the weight-sync link did not form: {e}", self.version) from e

    async def update(self, version: int, pause_mode: PauseMode = PauseMode.ABORT) -> SyncReport:
        """Sync the trainer's current weights into every engine as ``version``; see the module
        docstring for the protocol and what a failure leaves behind (raises WeightSyncError)."""
        async with self._lock:
            self.version = version
            engines = list(self.engines)
            progress = _Progress()
            try:
                report = await asyncio.wait_for(self._sync(engines, version, PauseMode(pause_mode), progress),
                                                self.settings.timeout_s)
            except BaseException as e:
                self._engine_base = None
                raise await self._fail(engines, version, progress, e) from e
            self._engine_base = version if self.settings.delta else None
            return report

    async def recover(self, client) -> None:
        """Bring ``client``'s engine (held after a failed sync, restarted, or new) to the current
        version through a disk checkpoint (written once per version), resume it, and sync it from
        now on. Its waiting requests then run on the new weights.

        The checkpoint of ``self.version`` is exported from the trainer when none exists yet, so
        call it before the trainer's next step changes its weights."""
        async with self._lock:
            t0 = time.perf_counter()
            path = self._disk.checkpoint(self.version)
            if path is None:
                try:
                    await self._connect(self._disk, [])
                    first = await self._begin_senders(self._disk, self.version)
                    indices, payloads, _, _ = await self._stream(self._disk, [], first, set(), None)
                except BaseException:
                    await _quietly(self.trainer.weight_sync_abort())
                    self._linked.clear()
                    raise
                path = self._disk.finalize(self.version, indices, payloads)
            await client.pause_generation(PauseMode.RETRACT)
            if client.base_url in self._open_sessions:  # a sync lost the engine inside its update session
                await _quietly(client.end_weight_update())  # (a restarted engine has none: refused, ignored)
                self._open_sessions.discard(client.base_url)
            await client.begin_weight_update()
            try:
                await client.load_weights_from_disk(path, weight_version=self.version, flush_cache=True)
            finally:
                await client.end_weight_update()
            await client.continue_generation()
            self.engines = [c for c in self.engines if c.base_url != client.base_url] + [client]
            self._engine_base = None  # it holds no delta baseline: the next sync goes whole
            if self._transport.name in self._linked:  # formed again, with this engine, at the next sync
                await self._transport.disconnect(self.trainer, self.engines)
                self._linked.discard(self._transport.name)
            log.info("%s recovered to version %d in %.1f s", client.base_url, self.version, time.perf_counter() - t0)

    async def close(self) -> None:
        """Tear the links down (best effort on engines that are gone)."""
        async with self._lock:
            for side in {self._transport, self._disk}:
                if side.name in self._linked:
                    await side.disconnect(self.trainer, self.engines)
            self._linked.clear()

    # --- one sync -----------------------------------------------------------------------------------
    async def _connect(self, side: EngineSide, engines: list) -> None:
        if side.name in self._linked:
            return
        await side.connect(self.trainer, engines)
        self._linked.add(side.name)

    async def _sync(self, engines: list, version: int, mode: PauseMode, progress: _Progress) -> SyncReport:
        t0 = time.perf_counter()
        if not engines:
            raise RuntimeError("no engine to sync (all failed or held: recover them first)")
        await self._connect(self._transport, engines)
        plan = DeltaPlan(self._engine_base, self.settings.delta_max_fraction) if self.settings.delta else None
        async def pause_and_begin(i, client):
            await client.pause_generation(mode)
            await client.begin_weight_update()
            progress.began.add(i)

        # the trainer packs and starts sending its first buckets while each engine pauses (ending its forward)
        # and opens its update session: the engines' control calls are off the path to the first load. All of
        # them end before a failure is raised, so that the failure path sees every session that was begun.
        first, *began = await asyncio.gather(self._begin_senders(self._transport, version, plan),
                                             *(pause_and_begin(i, c) for i, c in enumerate(engines)),
                                             return_exceptions=True)
        for outcome in (first, *began):
            if isinstance(outcome, BaseException):
                raise outcome
        finish = Finish(weight_version=version, flush_cache=mode is not PauseMode.IN_PLACE)
        per_bucket = self._transport.loads_per_bucket
        indices, payloads, stats, load_s = await self._stream(self._transport, engines, first, progress.touched,
                                                              finish if per_bucket else None)
        t_commit = time.perf_counter()
        progress.touched.update(range(len(engines)))
        await self._transport.commit(engines, version, indices, payloads, None if per_bucket else finish)
        load_s += time.perf_counter() - t_commit
        await _each(engines, lambda c: c.end_weight_update())
        await _each(engines, lambda c: c.continue_generation())
        report = SyncReport.of(functools.reduce(SenderStats.merge, stats), version, self._transport.name,
                               len(engines), load_s, time.perf_counter() - t0)
        log.info("weights of version %d synced into %d engines via %s: %.1f MB in %d buckets, %.2f s (%.2f GB/s)",
                 version, len(engines), report.transport, report.bytes / 1e6, report.buckets, report.total_s,
                 report.gbps)
        return report

    async def _begin_senders(self, side: EngineSide, version: int, delta: DeltaPlan | None = None):
        """Start the trainer's side of a sync to ``version`` through ``side`` (``delta``: a delta-mode
        sync's plan), gather every stage's first bucket and start sending it; as :meth:`_send`. It
        involves no engine (a transfer waits for the engines' receive): a sync runs it while they pause."""
        side.before_sync(version)
        await self.trainer.weight_sync_begin(side.name, version, self.settings.bucket_bytes, delta)
        return await self._send(side, await self._next())

    async def _send(self, side: EngineSide, ready: list[tuple[int, BucketIndex]]) -> list[tuple[BucketIndex, Any]]:
        """Start the transfer of the buckets ``ready`` (:meth:`_next`); (index, payload) of each, in order."""
        if not ready:
            return []
        sent = await self.trainer.weight_sync_send()
        return [(index, side.payload(rank, index, sent)) for rank, index in ready]

    async def _stream(self, side: EngineSide, engines: list, batch: list[tuple[BucketIndex, Any]],
                      touched: set[int], finish: Finish | None):
        """Every stage's buckets from the first ones, ``batch`` (sent by :meth:`_begin_senders`), loaded by
        ``engines`` as they come; the next bucket is gathered while the engines load the previous one, and
        sent once they have. ``finish`` rides on the last load (the batch in which every stage sends its
        last bucket). Returns (indices, payloads, every sender's :class:`SenderStats`, load seconds)."""
        indices: list[BucketIndex] = []
        payloads: list[Any] = []
        load_s = 0.0
        finished = finish is None
        while batch:
            final = all(index.last for index, _ in batch)
            finished = finished or final
            if side.loads_per_bucket:
                touched.update(range(len(engines)))
            loading = asyncio.ensure_future(self._load(side, engines, batch, finish if final else None))
            try:
                upcoming = await self._next()
            finally:
                load_s += await loading
            indices += [index for index, _ in batch]
            payloads += [payload for _, payload in batch]
            batch = await self._send(side, upcoming)
        stats = [s for s in await self.trainer.weight_sync_finish() if s is not None]
        if not finished:
            raise RuntimeError("the trainer sent no last bucket: the engines' weight version was not set")
        return indices, payloads, stats, load_s

    async def _next(self) -> list[tuple[int, BucketIndex]]:
        """(rank, index) of each stage's next bucket, stage order; empty when all stages are done."""
        results = await self.trainer.weight_sync_next()
        return sorted(((rank, index) for rank, index in enumerate(results) if index is not None),
                      key=lambda item: item[1].stage)

    @staticmethod
    async def _load(side: EngineSide, engines: list, batch: list, finish: Finish | None) -> float:
        """Load ``batch`` one engine call at a time (stages take turns); ``finish`` rides on its last call."""
        t0 = time.perf_counter()
        for i, (index, payload) in enumerate(batch):
            await side.load(engines, index, payload, finish if i == len(batch) - 1 else None)
        return time.perf_counter() - t0

    # --- failure ------------------------------------------------------------------------------------
    async def _fail(self, engines: list, version: int, progress: _Progress, cause: BaseException) -> WeightSyncError:
        timed_out = isinstance(cause, (asyncio.TimeoutError, TimeoutError))
        reason = past_bound("the sync", self.settings.timeout_s) if timed_out else f"{type(cause).__name__}: {cause}"
        log.error("weight sync to version %d failed (%s); cleaning up", version, reason)
        if not await _quietly(self.trainer.weight_sync_abort()):  # returns at once: transfers are left running
            log.error("trainer could not abort the weight sync")
        outcomes = await asyncio.gather(*(self._settle(i, c, progress) for i, c in enumerate(engines)))
        failed = [c.base_url for c, outcome in zip(engines, outcomes) if outcome == "failed"]
        self._open_sessions.update(c.base_url for i, c in enumerate(engines)
                                   if outcomes[i] == "failed" and i in progress.began)
        held = [c.base_url for c, outcome in zip(engines, outcomes) if outcome == "held"]
        if self._transport.name in self._linked:
            live = [c for c in engines if c.base_url not in failed]
            await _quietly(self._transport.disconnect(self.trainer, live))
        self._linked.clear()  # abort closed every link on the trainer
        gone = set(failed) | set(held)
        self.engines = [c for c in self.engines if c.base_url not in gone]
        return WeightSyncError(
            f"weight sync to version {version} failed ({reason}); engines failed: {failed or 'none'}; "
            f"held paused with partial weights until recover(): {held or 'none'}; "
            f"{len(self.engines)} engines resumed on their previous weights",
            version, failed, held,
        )


    @staticmethod
    async def _settle(i: int, client, progress: _Progress) -> str:
        """After a failed sync: "failed" for an engine that is dead or does not answer, "held" for one
        that may hold part of the new weights (it stays paused), else "resumed" on its old weights."""
        if not await _quietly(client.weight_version(), PROBE_TIMEOUT_S):  # dead, stuck or unreachable
            return "failed"
        if i in progress.began:
            await _quietly(client.end_weight_update())
        if i in progress.touched:
            return "held"
        return "resumed" if await _quietly(client.continue_generation()) else "failed"


async def _each(engines: list, call) -> None:
    await asyncio.gather(*(call(client) for client in engines))


async def _quietly(awaitable, timeout_s: float = CLEANUP_TIMEOUT_S) -> bool:
    """Await a best-effort cleanup call; False (logged) when it fails or takes longer than ``timeout_s``."""
    try:
        await asyncio.wait_for(awaitable, timeout_s)
        return True
    except BaseException as e:
        log.warning("weight-sync cleanup call failed: %s", e)
        return False
