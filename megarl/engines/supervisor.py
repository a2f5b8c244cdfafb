"""Who owns an engine process: the supervisor interface the engine pool restarts and stops engines
through, and the start of engines as Ray actors (``EngineActor``, one per engine, placed on its nodes).

:func:`start_engines` places and starts one actor per ``EngineSettings`` and returns each engine healthy
with its client (:class:`StartedEngine`), or stops every one it started before an error or a
cancellation propagates; :class:`RayEngineSupervisor` is the pool's handle on such an actor.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from megarl.engines.actor import DEFAULT_WATCHDOG, EngineInfo, WatchdogSettings
from megarl.engines.client import SGLangClient
from megarl.engines.types import EngineUnreachable, ServedModel

log = logging.getLogger(__name__)


class EngineSupervisor(Protocol):
    """What the pool needs from whoever owns an engine process."""

    async def ensure_healthy(self) -> EngineInfo:
        """Return once the engine runs (restarting it if it died); raise EngineUnreachable if it cannot."""
        ...

    async def gone(self, timeout_s: float) -> bool:
        """True when the owner is gone for good (e.g. its actor died with its node); False while it
        runs or cannot be asked within ``timeout_s``."""
        ...

    async def stop(self, timeout_s: float) -> None:
        """Stop the engine (best effort within ``timeout_s``: its node may be gone) and release its owner."""
        ...


class RayEngineSupervisor:
    """:class:`EngineSupervisor` over an ``EngineActor`` Ray actor handle."""

    def __init__(self, actor, placement=None):
        self.actor, self.placement = actor, placement

    async def ensure_healthy(self) -> EngineInfo:
        from ray.exceptions import RayActorError

        from megarl.engines.server import EngineDiedError

        try:
            return await self.actor.ensure_healthy.remote()
        except EngineDiedError as e:  # Ray re-raises the actor's exception as a subclass of its type
            raise EngineUnreachable(f"the engine actor gave up: {e}") from e
        except RayActorError as e:
            raise EngineUnreachable(f"the engine actor is gone (its node lost?): {e}") from e

    async def gone(self, timeout_s: float) -> bool:
        from ray.exceptions import ActorDiedError

        try:
            await asyncio.wait_for(self.actor.info.remote(), timeout_s)
        except ActorDiedError:
            return True
        except Exception:  # unavailable for now (its node unreachable) or slow: not known gone
            return False
        return False

    async def stop(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.actor.stop.remote(), timeout_s)
        except Exception as e:  # its node is gone, or it does not answer: killed below
            log.warning("stopping an engine actor: %s", e)
        finally:
            remove_engine_actors([self.actor], [self.placement])


@dataclass
class StartedEngine:
    """An engine started and healthy (:func:`start_engines`), not yet in a pool: its actor, the placement
    group of an engine over several nodes (else None), its info and a client."""

    actor: object
    placement: object
    info: EngineInfo
    client: SGLangClient

    @property
    def supervisor(self) -> RayEngineSupervisor:
        return RayEngineSupervisor(self.actor, self.placement)


async def start_engines(settings: Sequence, *, num_cpus: float = 0.5, num_gpus: float = 0,
                        watchdog: WatchdogSettings = DEFAULT_WATCHDOG, request_timeout_s: float = 600.0,
                        seats: Sequence | None = None) -> list[StartedEngine]:
    """One healthy engine per ``settings`` (see :meth:`megarl.engines.pool.EnginePool.launch`; ``seats[i]``:
    engine i's seats when it is pinned, :func:`megarl.engines.actor.launch_engine_actor`); on failure or
    cancellation the engines started are stopped before the error propagates."""
    import ray

    from megarl.engines.actor import engine_nodes, launch_engine_actor

    seats = [None] * len(settings) if seats is None else list(seats)
    if len(seats) != len(settings):
        raise ValueError(f"{len(settings)} engines but {len(seats)} seat lists")
    placements = [engine_nodes(s, num_cpus=num_cpus, num_gpus=num_gpus) if seat is None else None
                  for s, seat in zip(settings, seats)]
    actors = [launch_engine_actor(s, num_cpus=num_cpus, num_gpus=num_gpus, watchdog=watchdog, nodes=nodes, seats=seat)
              for s, nodes, seat in zip(settings, placements, seats)]
    try:
        await _placed(actors, max(s.startup_timeout_s for s in settings), num_cpus, num_gpus)
    except BaseException:
        remove_engine_actors(actors, placements)  # an actor never placed cannot be asked to stop
        raise
    try:
        infos = await asyncio.gather(*(a.start.remote() for a in actors))
    except BaseException:
        try:
            ray.get([a.stop.remote() for a in actors])  # blocking: a cancelled task must not leave servers behind
        finally:
            remove_engine_actors(actors, placements)
        raise
    # info.url: where the engine's node serves it (its node address on a multi-node cluster)
    return [StartedEngine(actor, placement, info, client_of(s, info.url, request_timeout_s))
            for actor, placement, info, s in zip(actors, placements, infos, settings)]


def client_of(settings, url: str, request_timeout_s: float = 600.0) -> SGLangClient:
    """The client of an engine started with ``settings`` (``EngineSettings``) that serves at ``url``; it
    prefills shared prompts only where the engine keeps a prefix cache to read them from, and asks for the
    support's log-probs where the settings say so."""
    shared = settings.shared_prefill_min_tokens if settings.prefix_cache else 0
    return SGLangClient(url, ServedModel.from_hf_config(settings.model_path), request_timeout_s,
                        api_key=settings.api_key, shared_prefill_min_tokens=shared,
                        support_logprobs=settings.support_logprobs)


async def _placed(actors: list, timeout_s: float, num_cpus: float, num_gpus: float) -> None:
    """Return once Ray has placed every engine actor (each asks ``num_cpus`` CPUs and ``num_gpus`` GPUs);
    EngineStartError after ``timeout_s`` naming what they need and what Ray has free (the trainer
    ranks, placed first, may have taken the GPUs the engines need)."""
    import ray

    from megarl.engines.server import EngineStartError

    try:
        await asyncio.wait_for(asyncio.gather(*(a.__ray_ready__.remote() for a in actors)), timeout_s)
    except TimeoutError:
        free, total = ray.available_resources(), ray.cluster_resources()
        raise EngineStartError(
            f"Ray placed not all {len(actors)} engines within {timeout_s:g} s (the engines' startup timeout): they "
            f"need {len(actors) * num_gpus:g} GPUs ({len(actors)} x {num_gpus:g}) and {len(actors) * num_cpus:g} "
            f"CPUs; Ray has {free.get('GPU', 0):g} GPUs free of {total.get('GPU', 0):g} and "
            f"{free.get('CPU', 0):g} CPUs free of {total.get('CPU', 0):g}. Give the run more GPUs "
            "(cluster.num_nodes, cluster.gpus_per_node) or fewer engines (rollout.num_engines, rollout.engine_tp)"
        ) from None


def remove_engine_actors(actors: list, placements: list) -> None:
    """Kill ``actors``, then remove ``placements`` (None entries skipped): the placement groups of
    engines over several nodes, whose removal would otherwise kill their actors mid-stop."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        ray.kill(actor)
    for placement in placements:
        if placement is not None:
            remove_placement_group(placement)
