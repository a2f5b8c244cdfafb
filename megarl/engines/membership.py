"""The engines of a pool and their membership: which take prompts, which are on their way out or back.

An engine is *active* (takes prompts), *leaving* (takes none; what it holds runs to its end), *lost*
(silent for ``lost_after_s``, or its restart did not come within that bound while another engine
serves: what it held is resubmitted to the others, once) or *gone* (stopped, or its actor died with its
node). :meth:`EngineMembership.watch` probes every engine each period and marks the silent ones lost
(never the last active one: with no other engine the pool waits for it). A lost engine that answers
again rejoins (:meth:`EngineMembership.rejoin`) through ``on_restart`` (a full weight sync), and so does
an engine started while the pool runs (:meth:`EngineMembership.start_engine` then
:meth:`EngineMembership.admit`); :meth:`EngineMembership.remove` drains an engine and stops it.

Recovery: when a request finds its engine unreachable (its process died, see
:class:`megarl.engines.actor.EngineActor`), :meth:`EngineMembership.recover` waits for the engine's
supervisor to restart it, re-pauses it if the pool is paused and calls ``on_restart`` (e.g. to push the
current weights) before the pool resubmits anything to it.

When the engines leave is the run's decision (:mod:`megarl.pipeline.membership`); the pool
(:class:`megarl.engines.pool.EnginePool`) places prompts on the active ones.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from megarl.engines.actor import EngineInfo
from megarl.engines.client import SGLangClient
from megarl.engines.supervisor import EngineSupervisor, RayEngineSupervisor, StartedEngine, start_engines
from megarl.engines.types import EngineError, EngineUnreachable, PauseMode, ServedModel

log = logging.getLogger(__name__)

RestartHook = Callable[[int, SGLangClient, EngineInfo], Awaitable[None]]

ACTIVE, LEAVING, LOST, GONE = "active", "leaving", "lost", "gone"  # an engine's membership (module docstring)


class PoolMember:
    """One engine of a pool: its client, supervisor (None: nobody restarts it), prompts in flight and state."""

    def __init__(self, index: int, client: SGLangClient, supervisor: EngineSupervisor | None):
        self.index, self.client, self.supervisor = index, client, supervisor
        self.in_flight = 0
        self.incarnation: int | None = None  # last seen EngineInfo.incarnation
        self.recovery = asyncio.Lock()  # one recovery at a time; the others wait for its on_restart
        self.state = ACTIVE
        self.cut = asyncio.Event()  # set when it is lost: its requests in flight are resubmitted elsewhere
        self.silent_since: float | None = None  # monotonic time of the first unanswered probe in a row
        self.answers = True  # the last probe's outcome


def active(members: Sequence[PoolMember]) -> list[PoolMember]:
    """The members of ``members`` that take prompts."""
    return [m for m in members if m.state == ACTIVE]


async def _end_open_update(client: SGLangClient) -> None:
    """End the weight-update session a sync left open on ``client``'s engine when it was cut off (the
    engine refuses when none is open: nothing to end)."""
    try:
        await client.end_weight_update()
    except EngineUnreachable:
        raise
    except EngineError:
        pass


class EngineMembership:
    """The members of one pool (by index, gone ones kept) and the calls that change their states.
    ``on_restart(index, client, info)`` brings an engine that restarted, rejoins or joins to the current
    weights; ``paused``: the pool's pause mode (None: not paused), applied to such an engine first;
    ``actors``/``placements``: the Ray actors (and placement groups) of the engines the pool launched."""

    def __init__(self, members: list[PoolMember], *, on_restart: RestartHook | None = None,
                 lost_after_s: float = 60.0):
        self.members = members
        self.on_restart, self.lost_after_s = on_restart, lost_after_s
        self.paused: PauseMode | None = None
        self.actors: list = []
        self.placements: list = []  # per launched engine, its placement group when over several nodes, else None
        self.idle = asyncio.Condition()  # notified when a request ends (drains and holds wait on it)

    @property
    def clients(self) -> list[SGLangClient]:
        """The clients of the engines not gone (weight sync and control go to these)."""
        return [m.client for m in self.members if m.state != GONE]

    @property
    def all_clients(self) -> list[SGLangClient]:
        """Every engine's client by index, gone ones included (aligned with :attr:`states`)."""
        return [m.client for m in self.members]

    @property
    def states(self) -> list[str]:
        """Each engine's membership (``active``, ``leaving``, ``lost``, ``gone``), by index."""
        return [m.state for m in self.members]

    @property
    def size(self) -> int:
        """The engines taking prompts now (active)."""
        return len(active(self.members))

    async def request_ended(self) -> None:
        async with self.idle:
            self.idle.notify_all()

    # --- recovery -------------------------------------------------------------------------------

    async def recover(self, member: PoolMember) -> None:
        """Wait until ``member`` runs again; after a restart, re-pause it and run ``on_restart``
        (every request that lost its engine waits for both before it is resubmitted). While another
        engine is active the wait is bounded by ``lost_after_s``: past it, or when the engine cannot
        come back, it is lost (its prompts go to the others); the last active engine is waited for."""
        async with member.recovery:
            if member.state != ACTIVE:
                return  # lost, leaving or gone: the prompts go to the others
            others = self.size > 1
            try:
                info = await asyncio.wait_for(member.supervisor.ensure_healthy(),
                                              self.lost_after_s if others else None)
            except (TimeoutError, EngineUnreachable) as e:
                if not others:
                    raise
                self.mark_lost(member.index, f"no restart within {self.lost_after_s:g} s" if isinstance(e, TimeoutError)
                               else f"it cannot come back ({e})")
                return
            if info.incarnation == member.incarnation:
                return  # no restart since the last recovery (or a dropped connection): resubmit as it is
            log.warning("engine %d restarted (incarnation %d, %d restarts)", member.index, info.incarnation,
                        info.restarts)
            await self._bring_up(member, info)
            member.incarnation = info.incarnation

    async def _bring_up(self, member: PoolMember, info: EngineInfo | None) -> None:
        """An engine about to take prompts again (restarted, rejoining, joining): paused like the pool,
        then ``on_restart``."""
        if self.paused is not None:
            await member.client.pause_generation(self.paused)
        if self.on_restart is not None:
            await self.on_restart(member.index, member.client, info)

    # --- lost, returned, joined and leaving engines ---------------------------------------------

    def mark_lost(self, index: int, why: str) -> None:
        """Engine ``index`` takes no more prompts and its requests in flight are resubmitted to the others."""
        member = self.members[index]
        if member.state in (LOST, GONE):
            return
        member.state, member.answers = LOST, False  # it returns once a probe gets an answer again
        member.cut.set()
        log.warning("engine %d at %s lost: %s; its requests go to the other %d engines", index,
                    member.client.base_url, why, self.size)

    async def watch(self, period_s: float) -> None:
        """Probe every engine each ``period_s`` (its weight version, answered within the period); an
        active one silent for ``lost_after_s`` while another is active is lost. Runs until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            await asyncio.gather(*(self._probe(m, period_s) for m in self.members if m.state in (ACTIVE, LOST)))

    async def _probe(self, member: PoolMember, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(member.client.weight_version(), timeout_s)
            member.answers, member.silent_since = True, None
            return
        except Exception:  # silent, refused or broken alike: not answering
            member.answers = False
        now = time.monotonic()
        member.silent_since = member.silent_since or now
        silent_s = now - member.silent_since
        if member.state == ACTIVE and silent_s >= self.lost_after_s and self.size > 1:
            self.mark_lost(member.index, f"no answer for {silent_s:.0f} s (lost_after_s {self.lost_after_s:g})")

    def returned(self) -> list[int]:
        """The lost engines that answered their last probe (for :meth:`rejoin`)."""
        return [m.index for m in self.members if m.state == LOST and m.answers and m.silent_since is None]

    async def rejoin(self, index: int) -> None:
        """Lost engine ``index``, answering again, takes prompts again after ``on_restart`` (a full sync);
        a weight-update session a sync cut off left open on it is ended first, and it is re-paused when
        the pool is paused."""
        member = self.members[index]
        async with member.recovery:
            if member.supervisor is not None:
                info = await member.supervisor.ensure_healthy()
                member.incarnation = info.incarnation
            else:
                info = None
            await _end_open_update(member.client)
            await self._bring_up(member, info)
            member.state, member.cut = ACTIVE, asyncio.Event()
        log.warning("engine %d at %s rejoined; %d engines take prompts", index, member.client.base_url, self.size)

    @staticmethod
    async def start_engine(settings, **launch_kwargs) -> StartedEngine:
        """Start one more engine (``settings``; :meth:`megarl.engines.pool.EnginePool.launch`'s keyword
        arguments) for :meth:`admit`."""
        return (await start_engines([settings], **launch_kwargs))[0]

    async def admit(self, started: StartedEngine) -> int:
        """Add an engine started while the pool runs (:meth:`start_engine`): ``on_restart`` brings it to
        the current weights (paused first when the pool is), then it takes prompts. Its index."""
        model: ServedModel = self.members[0].client.model
        if started.client.model != model:
            raise ValueError(f"the engine at {started.client.base_url} serves {started.client.model}, "
                             f"the pool {model}")
        member = PoolMember(len(self.members), started.client, started.supervisor)
        member.incarnation, member.state = started.info.incarnation, LEAVING  # takes no prompt before its sync
        self.members.append(member)
        self.actors.append(started.actor)
        self.placements.append(started.placement)
        async with member.recovery:
            await self._bring_up(member, started.info)
            member.state = ACTIVE
        log.info("engine %d joined at %s (node %s); %d engines take prompts", member.index, started.info.url,
                 started.info.node, self.size)
        return member.index

    async def remove(self, index: int, drain_s: float) -> None:
        """Engine ``index`` leaves: it takes no more prompts, its requests in flight run up to ``drain_s``
        (then they are resubmitted to the others), then it is stopped. ValueError for the last active engine."""
        member = self.members[index]
        if member.state == ACTIVE and self.size == 1:
            raise ValueError(f"engine {index} is the last one taking prompts: it cannot leave")
        if member.state == ACTIVE:
            member.state = LEAVING
        async with self.idle:
            try:
                await asyncio.wait_for(self.idle.wait_for(lambda: member.in_flight == 0), drain_s)
            except TimeoutError:
                log.warning("engine %d still had %d prompts after %g s of drain: resubmitting them", index,
                            member.in_flight, drain_s)
        member.cut.set()
        await self.discard(index)

    async def discard(self, index: int, timeout_s: float = 30.0) -> None:
        """Stop engine ``index`` (best effort: its node may be gone) and forget it."""
        member = self.members[index]
        if member.state == GONE:
            return
        member.state = GONE
        member.cut.set()
        await member.client.aclose()
        if member.supervisor is not None and hasattr(member.supervisor, "stop"):
            await member.supervisor.stop(timeout_s)
            if isinstance(member.supervisor, RayEngineSupervisor) and member.supervisor.actor in self.actors:
                at = self.actors.index(member.supervisor.actor)
                del self.actors[at], self.placements[at]
        log.info("engine %d at %s stopped and left the pool; %d engines take prompts", index,
                 member.client.base_url, self.size)

    async def gone(self, timeout_s: float) -> list[int]:
        """The lost engines whose owner is gone for good (their actor died with their node)."""
        lost = [m for m in self.members if m.state == LOST and m.supervisor is not None]
        found = await asyncio.gather(*(m.supervisor.gone(timeout_s) for m in lost))
        return [m.index for m, is_gone in zip(lost, found) if is_gone]
