"""The engines of a run: the policy's pool and one pool per auxiliary model (teacher, judge, frozen
agent roles), their settings, their launch and the moment they are healthy.

Disaggregated engines launch as the trainer ranks start building, so both sides load their
checkpoints at once; colocated ones launch once the ranks are built, since they size their memory by
what the trainer left (:attr:`EnginePlan.colocated`), each pinned to the nodes and GPUs of the trainer
ranks whose devices it shares (:mod:`megarl.engines.pinning`). Every launch is stopped (a start under way
cancelled, a healthy pool closed) when the run's exit stack closes.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.config.topology import RunTopology, engine_launch, pool_engine_settings
from megarl.engines.pinning import colocated_seats
from megarl.engines.pool import EnginePool
from megarl.engines.server import EngineSettings
from megarl.parallel.places import Place
from megarl.platform.description import Platform
from megarl.trainer.actor import TrainerGroup

log = logging.getLogger(__name__)

ENGINE_CPUS = 0.5  # the Ray CPU reservation of each engine's actor (the server process is not accounted)


@dataclass(frozen=True)
class EnginePlan:
    """The run's engine pools before they launch: pool name (``policy``, then each auxiliary pool's name)
    -> its engines' settings, and the GPUs each engine of it reserves through Ray; ``topology``: the run's
    pools and devices they were built from; ``affinity_slack``: each pool's (``rollout.affinity_slack``)."""

    settings: dict[str, list[EngineSettings]]
    gpus: dict[str, float]
    topology: RunTopology
    affinity_slack: int = 64

    @property
    def colocated(self) -> bool:
        """The policy engines share the trainer's devices: they launch after the ranks are built."""
        return self.topology.colocated

    def serving(self, server_module: str) -> EnginePlan:
        """This plan with every engine's server run as ``server_module`` (``python -m``)."""
        settings = {name: [dataclasses.replace(s, server_module=server_module) for s in pool]
                    for name, pool in self.settings.items()}
        return dataclasses.replace(self, settings=settings)


def plan_engines(cfg: DictConfig, start_checkpoint: str, api_key: str | None, platform: Platform) -> EnginePlan:
    """Every engine of the run ``cfg`` on ``platform``, each answering only ``api_key`` (None: any caller):
    the pools of its topology (:class:`megarl.config.topology.RunTopology`), each with its GPU decisions; disaggregated
    GPU engines reserve their devices through Ray (CUDA_VISIBLE_DEVICES reaches the server), colocated
    ones share the trainer's (each on its own, --base-gpu-id), CPU engines reserve half a CPU."""
    topology = cfg.topology
    settings = {p.name: pool_engine_settings(cfg, topology, p, platform, api_key,
                                             start_checkpoint if p.name == "policy" else None)
                for p in topology.pools}
    gpus = {p.name: engine_launch(p, platform, settings[p.name][0].model_path).ray_gpus
            for p in topology.pools}
    return EnginePlan(settings=settings, gpus=gpus, topology=topology, affinity_slack=cfg.rollout.affinity_slack)


def launch_engines(plan: EnginePlan, stack: contextlib.AsyncExitStack,
                   trainer_places: Sequence[Place] | None = None) -> dict[str, asyncio.Task]:
    """Pool name -> the task launching that pool (:meth:`EnginePool.launch`); when ``stack`` closes, a
    launch still under way is cancelled (which stops what it started) and a launched pool is closed.
    Colocated policy engines are pinned beside the trainer ranks whose devices they share
    (:func:`policy_seats`; ``trainer_places``: every rank's, by rank)."""
    seats = policy_seats(plan, trainer_places) if plan.colocated else None
    return {name: _launch(stack, settings, plan.gpus[name], plan.affinity_slack, seats if name == "policy" else None)
            for name, settings in plan.settings.items()}


def policy_seats(plan: EnginePlan, trainer_places: Sequence[Place] | None) -> list[list[Place]]:
    """Each colocated policy engine's seats (:func:`megarl.engines.pinning.colocated_seats`) from the places of
    the trainer ranks (by rank); ValueError without them (the ranks must be placed first)."""
    if trainer_places is None:
        raise ValueError("colocated engines are pinned beside the trainer ranks: place the ranks first and pass "
                         "their places")
    pool = plan.topology.policy
    nnodes = plan.settings["policy"][0].nnodes
    return [colocated_seats(trainer_places, e, pool.tp, nnodes) for e in range(pool.num_engines)]


def _launch(stack: contextlib.AsyncExitStack, settings: list[EngineSettings], num_gpus: float,
            affinity_slack: int, seats: list[list[Place]] | None) -> asyncio.Task:
    launch = asyncio.ensure_future(EnginePool.launch(settings, num_cpus=ENGINE_CPUS, num_gpus=num_gpus,
                                                     affinity_slack=affinity_slack, seats=seats))

    async def stop() -> None:
        launch.cancel()
        try:
            pool = await launch
        except (asyncio.CancelledError, Exception):  # stopped by the launch; an error of it was raised where awaited
            return
        await pool.aclose()

    stack.push_async_callback(stop)
    return launch


async def engines_ready(launches: dict[str, asyncio.Task], trainer: TrainerGroup) -> dict[str, EnginePool]:
    """Pool name -> its pool once every engine of every launch is healthy; logs where the trainer
    ranks and the policy engines run."""
    pools = dict(zip(launches, await asyncio.gather(*launches.values())))
    pool = pools["policy"]
    log.info("placement: trainer ranks on nodes %s, engines on nodes %s at %s", await trainer.node_addresses(),
             [a.node for a in await asyncio.gather(*(e.info.remote() for e in pool.actors))],
             [c.base_url for c in pool.clients])
    return pools
