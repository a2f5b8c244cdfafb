"""The engine's side of a weight-update group, joined and used within a bounded time.

SGLang 0.5.23 joins ``/init_weights_update_group`` with ``init_custom_process_group`` and no timeout:
torch's default (30 min for gloo, 10 min for NCCL) then bounds the rendezvous and every receive on the
group, and the engine's scheduler, which runs both, serves nothing while it waits for a trainer that is
gone. SGLang's request carries no timeout field, so the driver puts its bound in the group name
(:mod:`megarl.wire.group_timeout`) and :func:`install` (run in every SGLang process by
:mod:`megarl.engine_process.sglang_main`) makes SGLang's join pass it on (:func:`join`): the rendezvous,
the group's connection set-up and each broadcast the engine receives on it then fail after that time,
and the scheduler answers again. A name without the mark keeps torch's default.

NCCL (GPU): a receive is queued on NCCL's stream; the group's timeout is the watchdog's, which aborts
the communicator of a receive past it and, under torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
(tear down), ends the engine's process; its :class:`megarl.engines.actor.EngineActor` restarts it.
"""
from __future__ import annotations

import logging

from megarl.wire.group_timeout import timeout_of

log = logging.getLogger(__name__)

def join(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str):
    """Join ``group_name`` as ``rank`` of ``world_size`` (rank 0, the sender, hosts the rendezvous at
    ``master_address:master_port``), bounded by the name's timeout; the process group.
    Raises (torch's DistStoreError / RuntimeError) when the others do not all arrive in time."""
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.utils.network import NetworkAddress

    return init_custom_process_group(
        backend=backend, init_method=NetworkAddress(master_address, master_port).to_tcp(), world_size=world_size,
        rank=rank, group_name=group_name, timeout=timeout_of(group_name))


def init_weights_update_group(updater, master_address, master_port, rank_offset, world_size, group_name,
                              backend="nccl"):
    """SGLang's ``WeightUpdater.init_weights_update_group`` through :func:`join`: (success, message)."""
    if not group_name:
        return False, "Group name cannot be empty"
    rank = rank_offset + updater.tp_rank
    try:
        updater._model_update_group[group_name] = join(master_address, master_port, rank, world_size, group_name,
                                                       backend)
    except Exception as e:
        message = f"Failed to initialize custom process group: {e}."
        log.error(message)
        return False, message
    return True, "Succeeded to initialize custom process group."


def install() -> None:
    """Route SGLang's weight-update group joins in this process through :func:`join` (idempotent)."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    WeightUpdater.init_weights_update_group = init_weights_update_group
