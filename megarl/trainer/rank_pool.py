"""Warm trainer-rank processes kept between the trainer groups of one process (opt-in).

A rank process spends seconds of CPU importing torch, megatron-core and megatron-bridge before it can
join a group. A process that forms one trainer group after another (the test suite, a
notebook's sweep, a tool verifying several layouts) can keep those processes: inside :func:`keep_ranks`
a :class:`megarl.trainer.actor.TrainerGroup` that sets no ``env`` takes idle ranks from the pool, and
its shutdown hands them back once they have left their group (megatron's parallel state and
torch.distributed's process group destroyed; model, optimizer, reference and weight-sync links
dropped). A rank that fails to leave in time is killed, never reused; at most ``max_idle`` wait.

A kept rank's colocated weight-sync segments in ``/dev/shm`` stay while it lives (their sender's process
is alive, :func:`megarl.sync.transports.tensor.remove_orphaned_segments`); closing the pool waits for the
killed ranks to be gone and removes them.

Contract: Ray is connected when the block starts and stays connected until it ends. Kept ranks run
on this process's node (the group meets on its address) and reserve no CPU (``num_cpus=0``): an idle
one is a process waiting, not work; a rank in use is scheduled like any other actor of the node.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import ray

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 30.0  # leaving takes well under a second; a rank still busy in a call is killed
EXIT_TIMEOUT_S = 10.0  # a killed rank's process is gone in well under a second


@dataclass
class RankPool:
    """Idle rank actors (Ray actor handles) of this process's Ray connection, and their process ids."""

    max_idle: int
    idle: list[Any] = field(default_factory=list)
    pids: dict[Any, int] = field(default_factory=dict)

    def take(self, count: int, create: Callable[[], Any]) -> list[Any]:
        """``count`` rank actors: idle ones first, then ``create()``'d ones."""
        ranks = [self.idle.pop() for _ in range(min(count, len(self.idle)))]
        for rank in ranks:
            self.pids.pop(rank)
        return ranks + [create() for _ in range(count - len(ranks))]

    def give_back(self, ranks: list[Any], leave: Callable[[Any], Any]) -> None:
        """Make every rank leave its group (``leave(rank)`` -> an ObjectRef of its pid) and keep those
        that did."""
        pending = {rank: leave(rank) for rank in ranks}
        deadline = time.monotonic() + LEAVE_TIMEOUT_S  # one wait for all of them
        for rank, ref in pending.items():
            try:
                pid = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.debug("a kept rank did not leave its group (%s); killed", type(e).__name__)
                ray.kill(rank)
                continue
            if len(self.idle) < self.max_idle:
                self.idle.append(rank)
                self.pids[rank] = pid
            else:
                ray.kill(rank)

    def close(self) -> None:
        """Kill the idle ranks, wait for their processes to go, and remove the shared-memory segments
        they leave (those no live process maps)."""
        from megarl.sync.transports.tensor import remove_orphaned_segments

        processes = []
        for rank in self.idle:
            with contextlib.suppress(psutil.NoSuchProcess):
                processes.append(psutil.Process(self.pids[rank]))
            ray.kill(rank)
        self.idle.clear()
        self.pids.clear()
        _, alive = psutil.wait_procs(processes, timeout=EXIT_TIMEOUT_S)
        if alive:
            log.warning("kept ranks %s still running %.0f s after their kill", [p.pid for p in alive], EXIT_TIMEOUT_S)
        remove_orphaned_segments()


_pool: RankPool | None = None


def current() -> RankPool | None:
    """The active pool (inside :func:`keep_ranks`), else None."""
    return _pool


@contextlib.contextmanager
def keep_ranks(max_idle: int = 4) -> Iterator[RankPool]:
    """Keep up to ``max_idle`` trainer-rank processes warm between trainer groups inside the block;
    the kept ones are killed when it ends."""
    global _pool
    if not ray.is_initialized():
        raise RuntimeError("keep_ranks() needs a connected Ray (call ray.init first): the kept ranks live in "
                           "its cluster")
    if _pool is not None:
        raise RuntimeError("keep_ranks() is already active in this process")
    _pool = RankPool(max_idle)
    try:
        yield _pool
    finally:
        _pool.close()
        _pool = None
