"""The gather stage: this pipeline stage's Megatron shards -> full HF-named tensors, streamed.

Names, layouts and the TP/EP gathers are megatron-bridge's own (``AutoBridge.export_hf_weights``
with its conversion tasks: column/row parallel all-gathers, fused QKV and gate/up split into the
HF tensors, experts all-gathered over EP and expert-TP). megarl only restricts the export to the
parameters this pipeline stage owns and turns off the bridge's cross-stage broadcast, so every
stage exports its own layers in parallel and no tensor crosses a pipeline boundary: each stage has
its own sending rank (TP rank 0, DP rank 0 of the stage) and its own link to the engines.

Every rank of a stage must iterate the stream in lock-step (the gathers are collectives of the
stage's TP and EP groups); ranks that do not send drop each tensor as soon as it arrives.
"""
from __future__ import annotations

import functools
import logging
import types
from typing import Iterator

import torch

log = logging.getLogger(__name__)


def pipeline_stage() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank()


def pipeline_stages() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def is_stage_sender() -> bool:
    """True on the one rank per pipeline stage that sends: TP rank 0, DP (with CP) rank 0."""
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)


def forget_groups() -> None:
    """Drop the groups made here for this process's process group (before it is destroyed)."""
    _single_stage_groups.cache_clear()


@functools.cache
def _single_stage_groups():
    """A process-group collection whose pipeline group is this rank alone: the bridge's mappings
    then skip their cross-stage broadcast (``pp_size == 1``) and keep the TP/EP groups."""
    rank = torch.distributed.get_rank()
    group = torch.distributed.new_group([rank], use_local_synchronization=True)
    return types.SimpleNamespace(pp=group)


def stage_export_tasks(model) -> list:
    """The bridge's conversion tasks of this rank's pipeline stage, built on the first call and kept
    in ``model.export_tasks`` (they hold the parameters themselves, whose values change in place)."""
    if model.export_tasks is None:
        tasks = model.bridge.get_conversion_tasks(model.chunks)
        local = [t for t in tasks if t is not None and t.param_weight is not None]
        if pipeline_stages() > 1:
            groups = _single_stage_groups()
            for task in local:
                task.mapping.set_process_groups_from_pg_collection(groups)
        log.debug("stage %d exports %d of %d conversion tasks", pipeline_stage(), len(local), len(tasks))
        model.export_tasks = local
    return model.export_tasks


def stage_hf_stream(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every HF weight of this rank's pipeline stage, in the bridge's
    export order; tensors stay on the parameters' device. ``model`` is a
    :class:`megarl.models.bridge.MegatronModel`. Collective over the stage's TP/EP groups. LoRA adapters,
    where the model has them, come merged into their base weights; a model without them skips the
    bridge's search for them (a walk over every parameter and a gather over the pipeline group)."""
    for name, tensor in model.bridge.export_hf_weights(model.chunks, cpu=False, show_progress=False,
                                                       conversion_tasks=stage_export_tasks(model),
                                                       merge_adapter_weights=model.has_adapters):
        yield name, tensor
