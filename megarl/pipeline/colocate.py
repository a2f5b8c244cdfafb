"""Colocated placement: the trainer and the engines take turns on the same devices.

Around every training step (:class:`Colocation`, used by :class:`megarl.pipeline.run.Pipeline`):

before the step (:meth:`Colocation.before_training`, at the end of ``take_batch``)
    1. hold the engine pool: no request reaches an engine any more, so the producer's new groups
       (and resubmissions) wait in the pool;
    2. no request in flight: with ``buffer.partial_rollout=abort_resubmit`` the running requests
       are aborted (their samples are continued as prompt + prefix after the sync, on the new
       weights), with ``continue`` they run to their end first (an abort would cut them short, a
       retract would leave them queued in the engine through the step); every engine is then
       paused (:meth:`megarl.engines.pool.EnginePool.hold`);
    3. release the engines' weights and KV cache (SGLang's ``/release_memory_occupation``).

after the step (:meth:`Colocation.after_training`, around the weight sync)
    4. on CUDA the trainer gives back what it holds and does not use (its ranks empty their CUDA
       caching allocator: :func:`empty_trainer_cache`, which reports what each rank keeps), 5. resume
       the weights, 6. sync the trainer's weights into them (the ``tensor`` transport), 7. resume the
       KV cache, 8. continue the engines and let the held requests go.

Released weights come back uninitialised; the sync that follows overwrites every tensor. The KV
cache is resumed after the sync, so the sync's buckets do not compete with it for memory; the sync
ends with its own continue, before step 7, which is safe because step 2 left no request in the
engines and the pool keeps new ones until step 8.

Release needs engines started with ``--enable-memory-saver`` (torch_memory_saver, CUDA only;
:func:`megarl.config.topology.engine_launch`; a CUDA platform without it is refused when
the config loads). On CUDA engines that cannot release are an error. On the CPU the trainer and the
engines share host memory: the trainer has no device cache to empty, and the engines, started
without the flag (SGLang 0.5.23's release would kill a CPU engine's scheduler: it ends in
``torch.cuda.synchronize()``), skip the release; the rest of the protocol runs the same way, and
:class:`Colocation` says so once. The metrics: ``colocate/release_skipped`` (1 = nothing released),
``colocate/pause_s`` (steps 1-3), ``colocate/resume_s`` (steps 4, 5, 7 and 8; the sync itself is
``sync/seconds``), ``colocate/trainer_reserved_gb`` (CUDA: the most any rank keeps reserved after 4).

Modes: every mode runs colocated, and generation runs only between training steps: from the end
of one step's sync to the moment the next step's batch is complete. ``sync`` behaves as it does
disaggregated (nothing is generated while training there anyway). ``one_step_off`` and ``async``
keep their lag and buffer depth, so groups generated before a sync may be trained one step (up
to ``buffer.max_staleness`` steps) later; they just get no generation time during a step.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from megarl.platform.description import Platform, detect

log = logging.getLogger(__name__)

T = TypeVar("T")


class HeldPool(Protocol):
    """What colocation needs from the engine pool (:class:`megarl.engines.pool.EnginePool`)."""

    async def hold(self, *, abort: bool) -> None: ...
    async def unhold(self) -> None: ...
    async def memory_release_available(self) -> bool: ...
    async def release_memory(self, tags) -> None: ...
    async def resume_memory(self, tags) -> None: ...


def empty_trainer_cache(rank: int, layout) -> dict[str, float]:
    """On a CUDA trainer rank (run by :meth:`megarl.trainer.actor.TrainerGroup.run`): hand the blocks its
    caching allocator holds unused back to the device, for the engines to resume into; what the rank
    still holds, in GiB: ``allocated`` (live tensors: weights, gradient buffers, optimizer state on the
    device) and ``reserved`` (those plus what the allocator keeps)."""
    import torch

    torch.cuda.empty_cache()
    return {"allocated": torch.cuda.memory_allocated() / 2**30, "reserved": torch.cuda.memory_reserved() / 2**30}


async def trainer_release(trainer) -> list[dict[str, float]]:
    """Every trainer rank's :func:`empty_trainer_cache`, in rank order (logged); ``trainer``: a
    :class:`megarl.trainer.actor.TrainerGroup` (anything whose ``run(fn)`` gives each rank's awaitable)."""
    reports = list(await asyncio.gather(*trainer.run(empty_trainer_cache)))
    log.info("colocated: trainer ranks keep %s GiB reserved (%s allocated) while the engines resume",
             [round(r["reserved"], 2) for r in reports], [round(r["allocated"], 2) for r in reports])
    return reports


class Colocation:
    """Hands the devices from the engines to the trainer and back; see the module docstring.

    ``abort``: abort the requests in flight when the trainer takes over (else let them finish).
    ``platform``: where trainer and engines run (default: this machine). ``release_trainer``: on CUDA,
    makes every trainer rank give back its unused cached memory (step 4) and returns each rank's
    :func:`empty_trainer_cache` report; required on CUDA, unused on the CPU.
    """

    def __init__(self, pool: HeldPool, *, abort: bool, platform: Platform | None = None,
                 release_trainer: Callable[[], Awaitable[list[dict[str, float]]]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.pool, self.abort, self.clock = pool, abort, clock
        self.platform = detect() if platform is None else platform
        if self.platform.is_cuda and release_trainer is None:
            raise ValueError("colocated on CUDA the trainer must release its cached memory before the engines "
                             "resume: pass release_trainer")
        if not self.platform.is_cuda:
            log.info("colocated on the CPU: trainer and engines share host memory; the trainer has no device "
                     "cache to release between its step and the engines' turn")
        self.release_trainer = release_trainer if self.platform.is_cuda else None
        self._release: bool | None = None  # whether the engines can release (asked once)
        self._released = False
        self._metrics: dict[str, float] = {}

    async def before_training(self) -> None:
        """Steps 1-3: nothing in flight, every engine paused, its memory released if it can be."""
        t0 = self.clock()
        await self.pool.hold(abort=self.abort)
        if self._release is None:
            self._release = await self.pool.memory_release_available()
            if not self._release and self.platform.is_cuda:
                raise RuntimeError("colocated engines on CUDA cannot release their memory (started without "
                                   "--enable-memory-saver): the trainer would run out of memory")
            if not self._release:
                log.info("colocated: the engines cannot release their memory (no --enable-memory-saver); "
                         "pausing them around each training step without releasing it")
        if self._release:
            await self.pool.release_memory(("kv_cache", "weights"))
            self._released = True
        self._metrics = {"colocate/pause_s": self.clock() - t0, "colocate/release_skipped": float(not self._release)}

    async def after_training(self, sync: Callable[[], Awaitable[T]]) -> T:
        """Steps 4-8 around ``sync()`` (the weight sync; its result is returned). The engines are
        continued and the pool let go even when the sync raises."""
        resume_s = 0.0
        try:
            if self.release_trainer is not None:
                t0 = self.clock()
                reports = await self.release_trainer()
                resume_s += self.clock() - t0
                self._metrics["colocate/trainer_reserved_gb"] = max(r["reserved"] for r in reports)
            if self._released:
                t0 = self.clock()
                await self.pool.resume_memory(("weights",))
                resume_s += self.clock() - t0
            return await sync()
        finally:
            t0 = self.clock()
            if self._released:
                await self.pool.resume_memory(("kv_cache",))
                self._released = False
            await self.pool.unhold()
            self._metrics["colocate/resume_s"] = resume_s + self.clock() - t0

    def metrics(self) -> dict[str, float]:
        """The last step's ``colocate/*`` metrics (see the module docstring)."""
        return dict(self._metrics)
