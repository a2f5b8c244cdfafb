"""The trainer ranks and their nodes under watch: a run that loses a trainer node, or one rank's process
alone, ends at once.

A rank's collective with a rank on a dead node, or with a rank whose process died (killed by the kernel's
or Ray's memory monitor, crashed), waits for its own timeout (minutes to hours), so the driver does not
wait for it: every ``cluster.node_check_s`` it asks Ray which nodes are alive and asks each rank for its
process id (a call in the rank's concurrency group for aborts, answered while a step or a sync runs; Ray
fails it at once for a rank whose process is gone). The first trainer node Ray reports dead cancels the
run with :class:`TrainerNodeLost` naming it; a rank found dead on a node still alive, with
:class:`TrainerRankLost` naming the rank (a rank's collective that broke first, its peer gone, is held
until the watch reports the loss: :func:`confirmed_loss`). Both are a :class:`TrainerLost`: the run's last
checkpoint is intact (a save is published by a rename once complete); the driver exits with
:data:`NODE_LOST_EXIT`, on which ``slurm/megarl.sbatch`` requeues the job, and the requeued run resumes
from that checkpoint, its ranks started anew.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

NODE_LOST_EXIT = 75  # EX_TEMPFAIL: the job can run again (the SLURM script requeues it)


class TrainerLost(RuntimeError):
    """The trainer lost ranks (:class:`TrainerNodeLost`, :class:`TrainerRankLost`); the run can run again."""


class TrainerNodeLost(TrainerLost):
    """A node holding a trainer rank left the Ray cluster; the message names it."""


class TrainerRankLost(TrainerLost):
    """A trainer rank's process died while its node stayed in the Ray cluster; the message names the rank."""


def node_ids(addresses: list[str], nodes: list[dict]) -> dict[str, str]:
    """Address -> the Ray node id of the alive node at that address, for each of ``addresses``
    (``nodes``: ``ray.nodes()``); ValueError naming an address no alive node has."""
    alive = {n["NodeManagerAddress"]: n["NodeID"] for n in nodes if n["Alive"]}
    missing = sorted(set(addresses) - set(alive))
    if missing:
        raise ValueError(f"no alive Ray node at {missing}")
    return {a: alive[a] for a in addresses}


def dead_nodes(watched: dict[str, str], nodes: list[dict]) -> list[str]:
    """The addresses of ``watched`` (address -> node id) whose node ``nodes`` reports dead or no longer lists."""
    alive = {n["NodeID"] for n in nodes if n["Alive"]}
    return sorted(address for address, node_id in watched.items() if node_id not in alive)


async def watch_trainer(addresses: list[str], dead_ranks: Callable[[float], Awaitable[dict[int, str]]],
                        period_s: float) -> None:
    """Raise :class:`TrainerNodeLost` once Ray reports a node of ``addresses`` (the ranks' nodes) dead, or
    :class:`TrainerRankLost` once ``dead_ranks(timeout_s)`` (rank -> why, for the ranks whose process is
    gone; a rank that does not answer within the timeout is not counted) names a rank on a node still
    alive; checked every ``period_s``. Runs until then or until cancelled."""
    import ray

    try:
        watched = node_ids(sorted(set(addresses)), await asyncio.to_thread(ray.nodes))
    except ValueError as e:  # the ranks report addresses Ray's node table does not hold: nothing to watch by
        log.warning("the trainer nodes are not watched: %s", e)
        watched = {}
    while True:
        await asyncio.sleep(period_s)
        dead = dead_nodes(watched, await asyncio.to_thread(ray.nodes))
        if dead:
            raise TrainerNodeLost(f"trainer node {', '.join(dead)} left the Ray cluster (its ranks are gone)")
        ranks = await dead_ranks(period_s)
        if ranks:
            dead = dead_nodes(watched, await asyncio.to_thread(ray.nodes))  # a node's death shows in its ranks first
            if dead:
                raise TrainerNodeLost(f"trainer node {', '.join(dead)} left the Ray cluster (its ranks are gone)")
            raise TrainerRankLost(rank_loss_message(ranks, addresses))


def rank_loss_message(ranks: dict[int, str], addresses: list[str]) -> str:
    """One line naming the dead ``ranks`` (rank -> why) and their nodes (``addresses``: each rank's)."""
    named = "; ".join(f"rank {r} on {addresses[r]}: {why}" for r, why in sorted(ranks.items()))
    return f"trainer rank process died while its node stayed in the Ray cluster ({named})"


RANK_CLASS = "TrainerRank"  # the trainer ranks' actor class, as Ray names it in an actor's death


def rank_died_in(error: BaseException) -> TrainerRankLost | None:
    """The loss of a trainer rank's process when ``error`` (or an error it was raised from) is Ray's report
    of a call to a dead trainer rank (a start-up call, made before the watch runs); else None."""
    from ray.exceptions import RayActorError

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RayActorError) and f"class_name: {RANK_CLASS}" in str(error):
            lines = str(error).strip().splitlines()
            where = next((line.strip() for line in lines if line.strip().startswith("ip:")), "ip: unknown")
            return TrainerRankLost(f"trainer rank process died during start-up ({where}; {type(error).__name__}: "
                                   f"{lines[0] if lines else ''})")
        error = error.__cause__ or error.__context__
    return None


def cancel_on_loss(watch: asyncio.Task, task: asyncio.Task) -> None:
    """When ``watch`` ends with :class:`TrainerLost`, cancel ``task`` (the run), which then raises
    it (:func:`loss_of`)."""
    def done(finished: asyncio.Task) -> None:
        if not finished.cancelled() and isinstance(finished.exception(), TrainerLost):
            log.error("%s", finished.exception())
            task.cancel()

    watch.add_done_callback(done)


def loss_of(watch: asyncio.Task | None) -> BaseException | None:
    """The error ``watch`` ended with (None while it runs, when cancelled or when it was never started)."""
    if watch is None or not watch.done() or watch.cancelled():
        return None
    return watch.exception()


async def confirmed_loss(watch: asyncio.Task | None, error: BaseException, wait_s: float) -> BaseException | None:
    """After the run failed with ``error``: when it is a Ray error (a rank's collective broke as its
    peer's node or process went, or a call to a dead rank failed, before the watch saw it), wait up to
    ``wait_s`` for ``watch`` to report the loss; that loss, else None."""
    from ray.exceptions import RayError

    if watch is None or watch.done() or not isinstance(error, RayError):
        return loss_of(watch)
    try:
        await asyncio.wait([watch], timeout=wait_s)
    except asyncio.CancelledError:  # the loss, cancelling this task (cancel_on_loss): reported below
        asyncio.current_task().uncancel()
    return loss_of(watch)
