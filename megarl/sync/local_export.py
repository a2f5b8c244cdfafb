"""A trainer rank's own shards as HF-named slices, without the TP/EP gathers of the full export.

megatron-bridge's mappings turn a Megatron parameter into HF tensors by gathering it over its TP
group (and its experts over the EP group) and then splitting or renaming it. Run over process groups
of this rank alone, the same conversion gives this rank's shard in HF coordinates: a column-parallel
weight's rows, a row-parallel weight's columns, the gate and up rows of a fused gate/up weight, a
local expert under its global name (the bridge names an expert task by its global expert id). A fused
QKV shard is split with the rank's own head counts (heads and query groups over TP). Where the shard
sits in the full HF tensor follows from the mapping kind and the rank's TP (expert-TP for experts)
rank: chunk ``rank`` of ``size`` along the split dimension (:mod:`megarl.sync.slices`).
"""
from __future__ import annotations

import copy
import functools
import re
import types
from dataclasses import dataclass
from typing import Iterator

import torch

from megarl.sync.buckets import DTYPE_NAMES
from megarl.sync.slices import Piece, Split

EXPERT_NUMBER = re.compile(r"experts\.(\d+)\.")
VOCAB_PARAMS = ("word_embeddings.weight", "output_layer.weight")  # Megatron's vocab-parallel tables


@dataclass(frozen=True)
class LocalSlice:
    """One HF slice this rank holds: where it sits (``piece``), how the tensor is split (``split``),
    and its values (``tensor``: ``piece.slice_shape``, on the parameter's device)."""

    piece: Piece
    split: Split
    tensor: torch.Tensor


@functools.cache
def _own_groups():
    """A process-group collection of this rank alone, for the bridge's mappings (no gather at all)."""
    rank = torch.distributed.get_rank()
    group = torch.distributed.new_group([rank], use_local_synchronization=True)
    return types.SimpleNamespace(pp=group, tp=group, ep=group, expt_tp=group)


def local_tasks(model) -> list:
    """The bridge's conversion tasks of this rank's parameters with mappings over :func:`_own_groups`
    (a list of its own: the gathering export's tasks keep their groups)."""
    tasks = [t for t in model.bridge.get_conversion_tasks(model.chunks) if t is not None and t.param_weight is not None]
    for task in tasks:
        task.mapping.set_process_groups_from_pg_collection(_own_groups())
    return tasks


def _tp_position(is_expert: bool) -> tuple[int, int]:
    """(rank, size) of this rank in the group a parameter is split over: expert-TP for experts, else TP."""
    from megatron.core import parallel_state as ps

    if is_expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _split_dim(mapping, tensor: torch.Tensor) -> int | None:
    """The dimension a mapping splits its HF tensors along (None: replicated); ValueError for a
    mapping kind that sharded resharding does not know."""
    from megatron.bridge.models.conversion import param_mapping as pm

    mapping = getattr(mapping, "_mapping", None) or mapping  # AutoMapping: its detected delegate
    if isinstance(mapping, (pm.ColumnParallelMapping, pm.GatedMLPMapping, pm.QKVMapping)):
        return 0
    if isinstance(mapping, pm.RowParallelMapping):
        return 1 if tensor.dim() > 1 else None
    if isinstance(mapping, (pm.ReplicatedMapping, pm.DirectMapping)):
        return None
    raise ValueError(f"sync.transport=sharded: no slice rule for megatron-bridge's {type(mapping).__name__} "
                     f"({mapping.megatron_param}); use sync.transport=distributed")


def _convert(task) -> dict[str, torch.Tensor]:
    """The task's local shard as HF tensors (its mapping runs over this rank's own groups)."""
    from megatron.bridge.models.conversion.param_mapping import QKVMapping, split_qkv_weights

    mapping = task.mapping
    if not isinstance(mapping, QKVMapping):
        return mapping.megatron_to_hf(task.param_weight, task.megatron_module)
    tp = _tp_position(False)[1]
    config = copy.copy(mapping._get_config(task.megatron_module))
    config.kv_channels = config.kv_channels or config.hidden_size // config.num_attention_heads
    config.num_attention_heads //= tp
    config.num_query_groups //= tp
    packed = next(iter(mapping._tp_mapping.megatron_to_hf(task.param_weight, task.megatron_module).values()))
    q, k, v = split_qkv_weights(config, packed)
    return {mapping.hf_param["q"]: q, mapping.hf_param["k"]: k, mapping.hf_param["v"]: v}


def task_model_bytes(task) -> int:
    """The model bytes (export dtype) the trainer's ranks hold at this task's place in their task lists: its
    local shard's bytes times the ranks its parameter is split over (TP, expert-TP for an expert; 1 when
    replicated: megatron-core marks a split parameter ``tensor_model_parallel``), times the EP ranks for a
    routed expert (each holds other experts at the same place). A bucket of tasks covers the sum of these
    over the whole model, what its engine ranks assemble."""
    from megatron.core import parallel_state as ps

    param, is_expert = task.param_weight, task.mapping.is_expert
    dtype = task.weight_dtype if task.weight_dtype is not None and param.is_floating_point() else param.dtype
    split = _tp_position(is_expert)[1] if getattr(param, "tensor_model_parallel", False) else 1
    experts = ps.get_expert_model_parallel_world_size() if is_expert else 1
    return param.numel() * dtype.itemsize * split * experts


def task_slices(task, num_query_groups: int) -> Iterator[LocalSlice]:
    """The HF slices of one conversion task on this rank (``num_query_groups``: the model's KV heads)."""
    from megatron.bridge.models.conversion.param_mapping import QKVMapping

    is_expert = task.mapping.is_expert
    index, size = _tp_position(is_expert)
    kv_names = {task.mapping.hf_param["k"], task.mapping.hf_param["v"]} if isinstance(task.mapping, QKVMapping) else ()
    for name, tensor in _convert(task).items():
        if task.weight_dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(task.weight_dtype)
        split_dim = _split_dim(task.mapping, tensor)
        dim = split_dim if size > 1 else None
        expert = EXPERT_NUMBER.search(name) if is_expert else None
        split = Split(split_dim, kv_heads=num_query_groups if name in kv_names else 0,
                      expert=int(expert.group(1)) if expert else None,
                      vocab=task.global_param_name.endswith(VOCAB_PARAMS))
        shape = tuple(tensor.shape)
        if dim is None:
            piece = Piece.whole(name, DTYPE_NAMES[tensor.dtype], shape)
        else:
            rows = shape[dim]
            full = shape[:dim] + (rows * size,) + shape[dim + 1:]
            piece = Piece(name, DTYPE_NAMES[tensor.dtype], full, dim, index * rows, (index + 1) * rows)
        yield LocalSlice(piece, split, tensor.detach())
