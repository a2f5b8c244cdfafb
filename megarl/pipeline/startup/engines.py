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
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from megarl.config.schema import Placement
from megarl.config.validate import AuxiliaryEngine, auxiliary_engines
from megarl.engines.pool import EnginePool
from megarl.engines.server import EngineSettings
from megarl.pipeline.judge import judge_engine_settings
from megarl.platform.description import Platform
from megarl.trainer.actor import TrainerGroup

log = logging.getLogger(__name__)


def frozen_engine_settings(cfg: DictConfig, engine: AuxiliaryEngine, index: int, api_key: str) -> EngineSettings:
    """The engine of a frozen model (on-policy distillation's teacher, a frozen agent role): ``engine``'s
    checkpoint on its tp / ep ranks, otherwise served like the policy engines but without the policy's
    adapters (its weights are never synced), its seed that of engine ``index`` and its log
    ``<name>.log`` in the run directory."""
    served = EngineSettings.from_config(cfg, engine.hf_path, index, 0, tp=engine.devices, ep=engine.ep,
                                        dp_attention=engine.dp_attention)
    return dataclasses.replace(served, api_key=api_key, log_path=str(Path(cfg.logging.run_dir) / f"{engine.name}.log"),
                               lora_max_rank=0, lora_target_modules=())


def policy_engine_settings(cfg: DictConfig, start_checkpoint: str, api_key: str, platform) -> list[EngineSettings]:
    """The policy engines' settings on ``platform`` (a :class:`megarl.platform.description.Platform`),
    colocated ones each on its own GPUs of its node with the memory saver
    (:meth:`EngineSettings.colocated`)."""
    engines = [dataclasses.replace(EngineSettings.from_config(cfg, start_checkpoint, i, 0, platform=platform),
                                   api_key=api_key) for i in range(cfg.rollout.num_engines)]
    if Placement(cfg.placement) == Placement.colocated:
        engines = [e.colocated(i, cfg.cluster.gpus_per_node, platform) for i, e in enumerate(engines)]
    return engines


@dataclass(frozen=True)
class EnginePlan:
    """The run's engine pools before they launch: pool name (``policy``, then each auxiliary engine's
    name) -> its engines' settings, and the GPUs each engine of it reserves through Ray."""

    settings: dict[str, list[EngineSettings]]
    gpus: dict[str, float]
    auxiliary: list[AuxiliaryEngine]
    colocated: bool  # the policy engines share the trainer's devices: they launch after the ranks are built


def plan_engines(cfg: DictConfig, start_checkpoint: str, api_key: str, platform: Platform) -> EnginePlan:
    """Every engine of the run ``cfg`` on ``platform``, each answering only ``api_key``."""
    r = cfg.rollout
    colocated = Placement(cfg.placement) == Placement.colocated
    engines = policy_engine_settings(cfg, start_checkpoint, api_key, platform)
    # Disaggregated GPU engines reserve their devices through Ray (CUDA_VISIBLE_DEVICES reaches the
    # server); colocated ones share the trainer's (each on its own, --base-gpu-id), CPU engines reserve half a CPU
    own_gpus = r.engine_tp if platform.is_cuda and not colocated else 0
    # The teacher, the judge and frozen agent roles: an engine of its own each (weights never synced), on
    # devices of its own in either placement; a pool each, as the policy's engines are one
    auxiliary = auxiliary_engines(cfg)
    pooled = {"policy": engines}
    gpus = {"policy": own_gpus}
    for i, a in enumerate(auxiliary):
        pooled[a.name] = [judge_engine_settings(cfg, api_key) if a.name == "judge" else
                          frozen_engine_settings(cfg, a, r.num_engines + i, api_key)]
        gpus[a.name] = a.devices if platform.is_cuda else 0
    return EnginePlan(settings=pooled, gpus=gpus, auxiliary=auxiliary, colocated=colocated)


def launch_engines(plan: EnginePlan, stack: contextlib.AsyncExitStack) -> dict[str, asyncio.Task]:
    """Pool name -> the task launching that pool (:meth:`EnginePool.launch`); when ``stack`` closes, a
    launch still under way is cancelled (which stops what it started) and a launched pool is closed."""
    return {name: _launch(stack, settings, plan.gpus[name]) for name, settings in plan.settings.items()}


def _launch(stack: contextlib.AsyncExitStack, settings: list[EngineSettings], num_gpus: float) -> asyncio.Task:
    launch = asyncio.ensure_future(EnginePool.launch(settings, num_cpus=0.5, num_gpus=num_gpus))

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
