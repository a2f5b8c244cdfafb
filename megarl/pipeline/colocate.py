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
    4. resume the weights, 5. sync the trainer's weights into them (the ``tensor`` transport),
    6. resume the KV cache, 7. continue the engines and let the held requests go.

Released weights come back uninitialised; the sync that follows overwrites every tensor. The KV
cache is resumed after the sync, so the sync's buckets do not compete with it for memory.

Release needs engines started with ``--enable-memory-saver`` (torch_memory_saver, CUDA only;
:func:`memory_saver_args`). Without it the release is skipped and the rest of the protocol runs
the same way: on a GPU SGLang's release would free nothing, and on CPU (SGLang 0.5.23) it kills
the engine's scheduler (the release ends in ``torch.cuda.synchronize()``). The metrics say which:
``colocate/release_skipped`` (1 = nothing released), ``colocate/pause_s`` (steps 1-3),
``colocate/resume_s`` (steps 4, 6 and 7; the sync itself is ``sync/seconds``).

Modes: every mode runs colocated, and generation runs only between training steps: from the end
of one step's sync to the moment the next step's batch is complete. ``sync`` behaves as it does
disaggregated (nothing is generated while training there anyway). ``one_step_off`` and ``async``
keep their lag and buffer depth, so groups generated before a sync may be trained one step (up
to ``buffer.max_staleness`` steps) later; they just get no generation time during a step.
"""
from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class HeldPool(Protocol):
    """What colocation needs from the engine pool (:class:`megarl.engines.pool.EnginePool`)."""

    async def hold(self, *, abort: bool) -> None: ...
    async def unhold(self) -> None: ...
    async def memory_release_available(self) -> bool: ...
    async def release_memory(self, tags) -> None: ...
    async def resume_memory(self, tags) -> None: ...


def memory_saver_args(cuda: bool) -> tuple[str, ...]:
    """The SGLang flags colocated engines need to release their memory: ``--enable-memory-saver``
    on CUDA when torch_memory_saver is installed (SGLang refuses to start with the flag without
    it); none otherwise, and :class:`Colocation` then skips the release."""
    if cuda and importlib.util.find_spec("torch_memory_saver") is not None:
        return ("--enable-memory-saver",)
    if cuda:
        log.warning("colocated: torch_memory_saver is not installed; the engines keep their memory while the "
                    "trainer runs (pip install torch-memory-saver)")
    return ()


class Colocation:
    """Hands the devices from the engines to the trainer and back; see the module docstring.

    ``abort``: abort the requests in flight when the trainer takes over (else let them finish).
    """

    def __init__(self, pool: HeldPool, *, abort: bool, clock: Callable[[], float] = time.monotonic):
        self.pool, self.abort, self.clock = pool, abort, clock
        self._release: bool | None = None  # whether the engines can release (asked once)
        self._released = False
        self._metrics: dict[str, float] = {}

    async def before_training(self) -> None:
        """Steps 1-3: nothing in flight, every engine paused, its memory released if it can be."""
        t0 = self.clock()
        await self.pool.hold(abort=self.abort)
        if self._release is None:
            self._release = await self.pool.memory_release_available()
            if not self._release:
                log.info("colocated: the engines cannot release their memory (no --enable-memory-saver); "
                         "pausing them around each training step without releasing it")
        if self._release:
            await self.pool.release_memory(("kv_cache", "weights"))
            self._released = True
        self._metrics = {"colocate/pause_s": self.clock() - t0, "colocate/release_skipped": float(not self._release)}

    async def after_training(self, sync: Callable[[], Awaitable[T]]) -> T:
        """Steps 4-7 around ``sync()`` (the weight sync; its result is returned). The engines are
        continued and the pool let go even when the sync raises."""
        resume_s = 0.0
        try:
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
