"""A run's trainer ranks and engines placed and started, in the order the start-up needs.

:func:`place_run` starts the trainer ranks (:mod:`.trainer`), launches the engines (:mod:`.engines`):
disaggregated ones at once, so that both sides load their checkpoints together, colocated ones once the
ranks are built and placed, beside them; and returns everything healthy (:class:`Placed`). The processes
that run are the real ones (:class:`Processes`), or the placement rehearsal's stand-ins
(:mod:`megarl.rehearsal`), which run this same code.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.engines.pool import EnginePool
from megarl.engines.server import SERVER_MODULE
from megarl.parallel import Layout
from megarl.pipeline.startup.engines import EnginePlan, engines_ready, launch_engines, plan_engines
from megarl.pipeline.startup.trainer import Resumed, build_and_resume, start_trainer
from megarl.platform.description import Platform, detect
from megarl.trainer.actor import TrainerGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Processes:
    """What runs where the GPU work is: the trainer ranks' group (its ``rank_class``) and the module each
    engine server runs (``python -m``)."""

    group: type[TrainerGroup] = TrainerGroup
    server_module: str = SERVER_MODULE


@dataclass
class Placed:
    """The run's trainer ranks (built, and resumed as ``resumed`` says), its engine plan and its healthy pools
    (pool name -> pool)."""

    trainer: TrainerGroup
    plan: EnginePlan
    pools: dict[str, EnginePool]
    resumed: Resumed


async def work_platform(cfg: DictConfig) -> Platform:
    """The platform the run's trainer ranks and engines will run on: this process's, unless the Ray cluster
    has GPUs this process does not see (a driver on a CPU-only head or login node), in which case a task on a
    GPU node detects it, and the run's engines are checked against it
    (:func:`megarl.config.platform_rules.refuse_on_platform`, ConfigError naming the key)."""
    import ray

    from megarl.config.platform_rules import refuse_on_platform

    here = detect()
    if here.is_cuda or not ray.cluster_resources().get("GPU"):
        return here
    there = await ray.remote(num_cpus=0, num_gpus=1)(detect).remote()
    log.warning("this driver sees no GPU; the cluster's GPU nodes are %s (capability %s): the run is placed for them",
                there.device, there.capability)
    refuse_on_platform(cfg, there)
    return there


async def place_run(cfg: DictConfig, start_checkpoint: str, layout: Layout, stack: contextlib.AsyncExitStack,
                    platform: Platform, api_key: str, processes: Processes = Processes()) -> Placed:
    """The trainer ranks of ``layout`` and the engines of ``cfg`` on ``platform`` (each engine answering only
    ``api_key``), started from ``start_checkpoint``: disaggregated engines launch as the ranks start building,
    colocated ones once the ranks are built, pinned beside them. What they hold goes into ``stack``."""
    started = time.monotonic()
    trainer = start_trainer(cfg, layout, stack, platform, processes.group)
    plan = plan_engines(cfg, start_checkpoint, api_key, platform).serving(processes.server_module)
    launches = {} if plan.colocated else launch_engines(plan, stack)
    launched_s = time.monotonic() - started
    resumed = await build_and_resume(trainer, cfg, start_checkpoint)
    trainer_s = time.monotonic() - started
    if plan.colocated:  # beside the ranks whose devices they share
        launches, launched_s = launch_engines(plan, stack, await trainer.places()), trainer_s
    pools = await engines_ready(launches, trainer)
    log.info("start-up: engines (%s) launched at %.1f s, trainer ranks built at %.1f s, engines healthy at %.1f s",
             ", ".join(pools), launched_s, trainer_s, time.monotonic() - started)
    return Placed(trainer, plan, pools, resumed)
