"""Several SGLang engines behind one dispatcher: least-loaded placement, pause/continue on all,
and recovery when an engine dies mid-batch.

Placement: each prompt goes to the engine with the fewest in-flight prompts (requests sent and
not yet answered, counted per prompt; ties go to the lower index), and each engine's share of a
batch is sent as one request (SGLang batches it). A prompt with an affinity key (its prompt group's
id) goes to the engine that served the key last, which holds the group's prefixes, unless that
engine is ``affinity_slack`` prompts busier than the least-loaded one (:mod:`megarl.engines.affinity`).
The pool does not route through sglang-router (the Rust cache-aware router): routing through it
would hide which engine lost a request, which the recovery below needs.

Recovery: when an engine becomes unreachable, the pool waits for it to come back (its membership's
:meth:`~megarl.engines.membership.EngineMembership.recover`: restarted, re-paused, ``on_restart`` run)
and resubmits every prompt of the lost request, placed again least-loaded. A lost HTTP request
returns nothing, so each resubmission is the whole request; each prompt index yields exactly one
sample, whatever engines died. ``resubmitted`` counts the resubmitted prompts. A prompt lost more
than ``max_attempts`` times raises EngineError (an engine that crashes on a request every time);
an engine that cannot come back (no supervisor, or its actor gave up) raises EngineUnreachable.

Subsets: :meth:`EnginePool.subset` gives some of the pool's engines as engines of their own
(:class:`PoolSubset`: placement, and resubmission after a death, among those engines only; the
pool's hold and recovery apply), e.g. one multi-agent role per group of engines.

Membership (:attr:`EnginePool.membership`, :mod:`megarl.engines.membership`): which engines take prompts
(active, leaving, lost, gone), probed, lost, rejoined, admitted and removed there.

Hold (colocated placement, :mod:`megarl.pipeline.colocate`): while the pool is held no request
reaches an engine (new and resubmitted ones wait in the pool), and :meth:`EnginePool.hold` returns
once none is in flight; the engines' weights and KV cache can then be released and resumed.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from megarl.engines.actor import DEFAULT_WATCHDOG, WatchdogSettings
from megarl.engines.affinity import EngineAffinity
from megarl.engines.client import SGLangClient
from megarl.engines.membership import ACTIVE, LEAVING, EngineMembership, PoolMember, RestartHook, active
from megarl.engines.supervisor import EngineSupervisor, remove_engine_actors, start_engines
from megarl.engines.types import BatchResult, EngineError, EngineUnreachable, PauseMode, SamplingParams, ServedModel
from megarl.sample import RolloutSample

log = logging.getLogger(__name__)


async def _unless_cut(engine: PoolMember, request: Awaitable):
    """``request``'s result, or EngineUnreachable (the request cancelled) once ``engine`` is cut off."""
    task, cut = asyncio.ensure_future(request), asyncio.ensure_future(engine.cut.wait())
    try:
        await asyncio.wait([task, cut], return_when=asyncio.FIRST_COMPLETED)
    finally:
        cut.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)  # let the cancelled request close
        raise EngineUnreachable(f"engine {engine.index} at {engine.client.base_url} was cut off ({engine.state})")
    return task.result()


class EnginePool:
    """N engines behind one least-loaded dispatcher. ``clients[i]`` talks to engine i (weight sync
    goes to every client); ``supervisors[i]`` (optional) restarts engine i when it dies. Use a pool
    from one asyncio event loop: its HTTP connections belong to the loop that opened them.
    ``affinity_slack``: see the module docstring."""

    def __init__(self, clients: Sequence[SGLangClient], supervisors: Sequence[EngineSupervisor] | None = None,
                 *, on_restart: RestartHook | None = None, max_attempts: int = 3, affinity_slack: int = 64,
                 lost_after_s: float = 60.0):
        if not clients:
            raise ValueError("an EnginePool needs at least one engine")
        if supervisors is not None and len(supervisors) != len(clients):
            raise ValueError(f"{len(clients)} clients but {len(supervisors)} supervisors")
        models = {c.model for c in clients}
        if len(models) != 1:
            raise ValueError(f"the engines serve different models: {models}")
        self.membership = EngineMembership(
            [PoolMember(i, c, supervisors[i] if supervisors else None) for i, c in enumerate(clients)],
            on_restart=on_restart, lost_after_s=lost_after_s)
        self._engines = self.membership.members  # by index, gone ones kept
        self.max_attempts = max_attempts
        self.affinity = EngineAffinity(affinity_slack)
        self.resubmitted = 0  # prompts resubmitted after an engine died, over the pool's life
        self._open = asyncio.Event()  # cleared while held: requests wait in the pool (see hold())
        self._open.set()
        self._released: dict[int, tuple[int | None, set[str]]] = {}  # engine -> (incarnation, released tags)

    @property
    def clients(self) -> list[SGLangClient]:
        """The clients of the engines not gone (weight sync and control go to these)."""
        return self.membership.clients

    @property
    def size(self) -> int:
        """The engines taking prompts now (active)."""
        return self.membership.size

    @property
    def model(self) -> ServedModel:
        return self._engines[0].client.model

    @property
    def in_flight(self) -> list[int]:
        """In-flight prompts per engine."""
        return [e.in_flight for e in self._engines]

    @classmethod
    async def launch(cls, settings: Sequence, *, num_cpus: float = 0.5, num_gpus: float = 0,
                     watchdog: WatchdogSettings = DEFAULT_WATCHDOG, request_timeout_s: float = 600.0,
                     seats: Sequence | None = None, **pool_kwargs) -> EnginePool:
        """Start one ``EngineActor`` per ``EngineSettings`` in parallel (Ray must be initialised;
        :func:`megarl.engines.supervisor.start_engines`), wait until all are healthy, and return the pool
        over them. Ray must place every engine's actor (``num_gpus`` GPUs, ``num_cpus`` CPUs each) within
        the engines' startup timeout (``EngineSettings.startup_timeout_s``), else EngineStartError says
        what they need and what Ray has free. ``watchdog``: how each actor watches its server. ``seats[i]``
        pins engine i beside the trainer ranks whose devices it shares (colocated, :mod:`megarl.engines.pinning`).
        On failure or cancellation the engines started are stopped before the error propagates."""
        launched = await start_engines(settings, num_cpus=num_cpus, num_gpus=num_gpus,
                                       watchdog=watchdog, request_timeout_s=request_timeout_s, seats=seats)
        pool = cls([e.client for e in launched], [e.supervisor for e in launched], **pool_kwargs)
        pool.membership.actors = [e.actor for e in launched]
        pool.membership.placements = [e.placement for e in launched]
        for engine, started in zip(pool._engines, launched):
            engine.incarnation = started.info.incarnation
        log.info("engine pool: %d engines at %s (nodes %s)", len(launched), [e.info.url for e in launched],
                 [e.info.node for e in launched])
        return pool

    @property
    def actors(self) -> list:
        """The Ray actor handles of the engines this pool launched ([] for a pool over given clients)."""
        return list(self.membership.actors)

    async def aclose(self) -> None:
        """Close the clients, stop the engines this pool launched and remove their actors (a Ray the
        caller keeps connected gets its resources back). Closing again does nothing more."""

        for engine in self._engines:
            await engine.client.aclose()
        members = self.membership
        if members.actors:
            try:
                await asyncio.gather(*(a.stop.remote() for a in members.actors))
            finally:
                remove_engine_actors(members.actors, members.placements)
                members.actors, members.placements = [], []

    # --- generation ---------------------------------------------------------------------------

    async def generate_batch(self, prompts: list[list[int]], params: SamplingParams, *, group_ids: list[str],
                             return_routed_experts: bool = True, return_sampling_mask: bool = True,
                             affinity: Sequence[str | None] | None = None,
                             prefix_routes: Sequence[np.ndarray | None] | None = None) -> list[RolloutSample]:
        """One sample per prompt, in order; the contract of ``SGLangClient.generate_batch``, spread
        over the engines and surviving engine deaths (see the module docstring); ``affinity[i]``:
        prompt ``i``'s affinity key (None: none); ``prefix_routes[i]``: the routes to replay over
        prompt ``i``'s prefix (None: none)."""
        result = await self.generate_batch_counted(prompts, params, group_ids=group_ids,
                                                   return_routed_experts=return_routed_experts,
                                                   return_sampling_mask=return_sampling_mask, affinity=affinity,
                                                   prefix_routes=prefix_routes)
        return result.samples

    async def generate_batch_counted(self, prompts: list[list[int]], params: SamplingParams, *, group_ids: list[str],
                                     return_routed_experts: bool = True, return_sampling_mask: bool = True,
                                     affinity: Sequence[str | None] | None = None,
                                     prefix_routes: Sequence[np.ndarray | None] | None = None) -> BatchResult:
        """:meth:`generate_batch` that also says how many prompts were resubmitted."""
        return await self._generate(self._engines, prompts, params, group_ids, return_routed_experts,
                                    return_sampling_mask, affinity, prefix_routes)

    def subset(self, indices: Sequence[int]) -> PoolSubset:
        """Engines ``indices`` of this pool as engines of their own (see the module docstring);
        ValueError unless they are distinct indices of this pool's engines, at least one."""
        indices = list(indices)
        if not indices or len(set(indices)) != len(indices) or not all(
                isinstance(i, int) and 0 <= i < len(self._engines) for i in indices):
            raise ValueError(f"engine indices must be distinct, at least one, each in [0, {len(self._engines)}); "
                             f"got {indices}")
        return PoolSubset(self, [self._engines[i] for i in indices])

    async def _generate(self, engines: list[PoolMember], prompts: list[list[int]], params: SamplingParams,
                        group_ids: list[str], return_routed_experts: bool, return_sampling_mask: bool,
                        affinity: Sequence[str | None] | None = None,
                        prefix_routes: Sequence[np.ndarray | None] | None = None) -> BatchResult:
        """:meth:`generate_batch_counted` placed among ``engines`` (all of the pool's, or a subset's)."""
        if len(group_ids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(group_ids)} group ids")
        if affinity is not None and len(affinity) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(affinity)} affinity keys")
        samples: list[RolloutSample | None] = [None] * len(prompts)
        resubmitted = 0

        async def run(engine: PoolMember, indices: list[int], attempt: int) -> None:
            nonlocal resubmitted
            await self._open.wait()  # not while the pool is held (colocated: the trainer has the devices)
            if engine.state not in (ACTIVE, LEAVING):  # lost while this request waited: not sent, placed again
                await asyncio.gather(*(run(e, part, attempt) for e, part in self._place(engines, indices, affinity)))
                return
            engine.in_flight += len(indices)
            try:
                out = await _unless_cut(engine, engine.client.generate_batch(
                    [prompts[i] for i in indices], params, group_ids=[group_ids[i] for i in indices],
                    return_routed_experts=return_routed_experts, return_sampling_mask=return_sampling_mask,
                    prefix_routes=None if prefix_routes is None else [prefix_routes[i] for i in indices]))
            except EngineUnreachable as e:
                if engine.supervisor is None and not engine.cut.is_set():
                    raise  # nobody restarts this engine
                if attempt >= self.max_attempts:
                    raise EngineError(f"engine {engine.index} lost {len(indices)} prompts {attempt} times "
                                      f"(max_attempts): {e}") from e
                log.warning("engine %d lost a request of %d prompts (%s); resubmitting it", engine.index,
                            len(indices), e)
            else:
                for i, sample in zip(indices, out):
                    samples[i] = sample
                return
            finally:
                engine.in_flight -= len(indices)
                await self.membership.request_ended()
            await self.membership.recover(engine)
            resubmitted += len(indices)
            self.resubmitted += len(indices)
            await asyncio.gather(*(run(e, part, attempt + 1)
                                   for e, part in self._place(engines, indices, affinity)))

        await asyncio.gather(*(run(e, part, 1)
                               for e, part in self._place(engines, list(range(len(prompts))), affinity)))
        assert all(s is not None for s in samples)
        return BatchResult(samples=samples, resubmitted=resubmitted)

    def _place(self, engines: list[PoolMember], indices: list[int],
               affinity: Sequence[str | None] | None) -> list[tuple[PoolMember, list[int]]]:
        """Placement (:class:`EngineAffinity`) among the active ones of ``engines``; EngineUnreachable when
        none is."""
        candidates = active(engines)
        if not candidates:
            raise EngineUnreachable(f"no engine left to take prompts: engines {[e.index for e in engines]} are "
                                    f"{[e.state for e in engines]}")
        return self.affinity.place(candidates, indices, affinity)

    # --- control ------------------------------------------------------------------------------

    async def _on_every_engine(self, call: Callable[[SGLangClient], Awaitable]) -> list:
        async def one(engine: PoolMember):
            try:
                return await call(engine.client)
            except EngineUnreachable:
                if engine.supervisor is None:
                    raise
                await self.membership.recover(engine)
                if engine.state not in (ACTIVE, LEAVING):
                    return None  # lost meanwhile: it rejoins through a full sync (rejoin)
                return await call(engine.client)

        live = [e for e in self._engines if e.state in (ACTIVE, LEAVING)]
        return list(await asyncio.gather(*(one(e) for e in live)))

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        """Pause every engine (see ``SGLangClient.pause_generation``); an engine restarted while the
        pool is paused is paused too before anything is resubmitted to it."""
        self.membership.paused = PauseMode(mode)
        await self._on_every_engine(lambda c: c.pause_generation(mode))

    async def continue_generation(self) -> None:
        await self._on_every_engine(lambda c: c.continue_generation())
        self.membership.paused = None

    # --- hold and memory release (colocated placement: megarl.pipeline.colocate) ----------------

    @property
    def held(self) -> bool:
        return not self._open.is_set()

    async def hold(self, *, abort: bool, abort_interval_s: float = 0.2) -> None:
        """Send nothing more to the engines until :meth:`unhold` (new and resubmitted requests wait
        in the pool), and return once no request is in flight, every engine paused. ``abort``:
        in-flight requests are aborted (they return at once with what they generated: for callers
        that resubmit aborted samples); else they run to their end first.

        The engines are paused only once nothing is in flight: a request that left the pool just
        before the hold but reaches an engine after a pause would wait inside the engine until the
        pause ends (SGLang holds it before its scheduler, where no abort reaches it). Aborting
        without pausing, every ``abort_interval_s`` until none is left, catches such late ones."""
        self._open.clear()
        while sum(self.in_flight):
            if abort:
                await self._on_every_engine(lambda c: c.abort_all_requests())
            async with self.membership.idle:
                try:
                    await asyncio.wait_for(self.membership.idle.wait_for(lambda: sum(self.in_flight) == 0),
                                           abort_interval_s if abort else None)
                except TimeoutError:
                    pass
        # Nothing is left to retract; unlike an abort pause, a retract pause reaches the scheduler
        # (SGLang's memory release checks it) and returns at once (an abort pause polls every 1 s).
        await self.pause(PauseMode.RETRACT)

    async def unhold(self) -> None:
        """Continue every engine and send the requests that waited (see :meth:`hold`)."""
        await self.continue_generation()
        self._open.set()

    async def memory_release_available(self) -> bool:
        """Whether every engine can release its memory (``SGLangClient.memory_saver_enabled``)."""
        return all(await self._on_every_engine(lambda c: c.memory_saver_enabled()))

    async def release_memory(self, tags: Sequence[str]) -> None:
        """Release the memory regions ``tags`` of every engine (held, see :meth:`hold`)."""
        await self._on_every_engine(lambda c: c.release_memory(tags))
        for e in self._engines:
            incarnation, released = self._released.get(e.index, (e.incarnation, set()))
            self._released[e.index] = (e.incarnation, released | set(tags))

    async def resume_memory(self, tags: Sequence[str]) -> None:
        """Map the regions ``tags`` again on every engine that released them and still runs the
        incarnation that did (a restarted engine starts with all its memory mapped)."""
        async def one(engine: PoolMember) -> None:
            incarnation, released = self._released.get(engine.index, (None, set()))
            todo = [t for t in tags if t in released]
            if todo and incarnation == engine.incarnation:
                await engine.client.resume_memory(todo)
            if released - set(todo):
                self._released[engine.index] = (incarnation, released - set(todo))
            else:
                self._released.pop(engine.index, None)

        await asyncio.gather(*(one(e) for e in self._engines))

    async def weight_versions(self) -> list[int]:
        """The weight version each engine serves (active or leaving)."""
        return [v for v in await self._on_every_engine(lambda c: c.weight_version()) if v is not None]

    async def weight_version(self) -> int:
        """The oldest weight version any engine serves (all equal outside a weight sync)."""
        return min(await self.weight_versions())


class PoolSubset:
    """Some engines of an :class:`EnginePool` behind the generate calls of
    :class:`~megarl.engines.protocol.Engines` (made by :meth:`EnginePool.subset`): prompts are placed
    least-loaded among them, and a prompt lost with its engine is resubmitted among them; holds,
    pauses, weight sync and recovery stay the pool's."""

    def __init__(self, pool: EnginePool, engines: list[PoolMember]):
        self.pool, self._engines = pool, engines

    @property
    def indices(self) -> list[int]:
        """The pool's indices of these engines."""
        return [e.index for e in self._engines]

    @property
    def model(self) -> ServedModel:
        return self.pool.model

    generate_batch = EnginePool.generate_batch  # the samples of this class's generate_batch_counted

    async def generate_batch_counted(self, prompts: list[list[int]], params: SamplingParams, *, group_ids: list[str],
                                     return_routed_experts: bool = True, return_sampling_mask: bool = True,
                                     affinity: Sequence[str | None] | None = None,
                                     prefix_routes: Sequence[np.ndarray | None] | None = None) -> BatchResult:
        """:meth:`EnginePool.generate_batch_counted` on these engines only."""
        return await self.pool._generate(self._engines, prompts, params, group_ids, return_routed_experts,
                                         return_sampling_mask, affinity, prefix_routes)
