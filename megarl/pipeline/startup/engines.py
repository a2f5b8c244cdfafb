"""The engines of a run: the policy's pool and one pool per auxiliary model (teacher, judge, frozen
agent roles), their settings, their launch and the moment they are healthy.

Disaggregated engines launch as the trainer ranks start building, so both sides load their
checkpoints at once; colocated ones launch once the ranks are built, since they size their memory by
what the trainer left (:attr:`EnginePlan.colocated`). Every launch is stopped (a start under way
cancelled, a healthy pool closed) when the run's exit stack closes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.config.topology import RunTopology, engine_launch, pool_engine_settings
from megarl.engines.pool import EnginePool
from megarl.engines.server import EngineSettings
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


def plan_engines(cfg: DictConfig, start_checkpoint: str, api_key: str | None, platform: Platform) -> EnginePlan:
    """Every engine of the run ``cfg`` on ``platform``, each answering only ``api_key`` (None: any caller):
    the pools of its topology (:class:`megarl.config.topology.RunTopology`), each with its GPU decisions; disaggregated
    GPU engines reserve their devices through Ray (CUDA_VISIBLE_DEVICES reaches the server), colocated
    ones share the trainer's (each on its own, --base-gpu-id), CPU engines reserve half a CPU."""
    topology = RunTopology.from_config(cfg)
    settings = {p.name: pool_engine_settings(cfg, topology, p, platform, api_key,
                                             start_checkpoint if p.name == "policy" else None)
                for p in topology.pools}
    gpus = {p.name: engine_launch(topology, p, 0, platform, settings[p.name][0].model_path).ray_gpus
            for p in topology.pools}
    return EnginePlan(settings=settings, gpus=gpus, topology=topology, affinity_slack=cfg.rollout.affinity_slack)


def launch_engines(plan: EnginePlan, stack: contextlib.AsyncExitStack) -> dict[str, asyncio.Task]:
    """Pool name -> the task launching that pool (:meth:`EnginePool.launch`); when ``stack`` closes, a
    launch still under way is cancelled (which stops what it started) and a launched pool is closed."""
    return {name: _launch(stack, settings, plan.gpus[name], plan.affinity_slack)
            for name, settings in plan.settings.items()}


def _launch(stack: contextlib.AsyncExitStack, settings: list[EngineSettings], num_gpus: float,
            affinity_slack: int) -> asyncio.Task:
    launch = asyncio.ensure_future(EnginePool.launch(settings, num_cpus=ENGINE_CPUS, num_gpus=num_gpus,
                                                     affinity_slack=affinity_slack))

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
