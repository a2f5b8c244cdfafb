"""The weight sync of a run between its trainer ranks and its policy engines.

:func:`start_sync` links them (:class:`megarl.sync.WeightSync`, or :class:`megarl.sync.AdapterSync`
for ``lora.sync=adapter``), brings a resumed run's engines to the checkpoint's weights before they
generate anything, and has the pool bring a restarted engine back to the current version.
"""
from __future__ import annotations

import contextlib

from omegaconf import DictConfig

from megarl.engines.pool import EnginePool
from megarl.pipeline.modes import PAUSE_FOR_PARTIAL_ROLLOUT
from megarl.sync import AdapterSync, SyncSettings, WeightSync
from megarl.trainer.actor import TrainerGroup


async def start_sync(cfg: DictConfig, trainer: TrainerGroup, pool: EnginePool, start_step: int,
                     stack: contextlib.AsyncExitStack) -> WeightSync | AdapterSync:
    """The sync from ``trainer`` into ``pool``'s engines, set up, its engines at version ``start_step``
    (the run's last completed step; 0: they already serve the starting checkpoint); closed when
    ``stack`` closes."""
    lora = cfg.enabled_lora
    sync_kind = AdapterSync if lora is not None and lora.sync == "adapter" else WeightSync
    sync = sync_kind(SyncSettings.from_config(cfg.sync, cfg.rollout.engine_tp), trainer, pool.clients,
                     initial_version=0)
    stack.push_async_callback(sync.close)
    await sync.setup()
    if start_step:  # the engines get the checkpoint's weights before they generate anything
        await sync.update(start_step, PAUSE_FOR_PARTIAL_ROLLOUT[cfg.buffer.partial_rollout])

    async def bring_to_current(index, client, info):
        await sync.recover(client)

    pool.membership.on_restart = bring_to_current
    return sync
