"""Bytes moved per weight sync and its time over the trainer->engine link.

Every engine receives the full main model (HF tensors, ``model.dtype``; the MTP modules are not
synced) in buckets of at most ``sync.bucket_mb`` MiB; a tensor larger than a bucket travels alone.
The estimate is the transfer alone, ``bytes * 8 / link_gbps``: a pipelined broadcast delivers the
model to all engines in about the time one receives it; gathering TP/EP shards and the engine's
load are not included.

With LoRA synced as adapters (``lora.enabled``, ``lora.sync=adapter``) an engine receives the
adapters alone, in HF PEFT form (:mod:`megarl.planner.lora`): one ``adapter_model.safetensors``
the trainer writes and every engine loads (megarl/sync/adapter.py), not bucketed. The time is
projected the same way, at ``sync.link_gbps``. ``lora.sync=merged`` moves the full model.

Each way a sync can go is projected beside it (:class:`SyncPath`, transfer time only, with the
inputs of its formula): ``broadcast`` (the above), ``delta`` (``sync.delta``: the changed elements
alone at a change fraction, :func:`delta_wire_fraction`, after each stage's sender compares its stage
with the host copy it kept, read to the GPU at ``h2d_gbps``), ``colocated_ipc`` (megarl's ``tensor`` route:
each stage's sender broadcasts its buckets to the trainer rank on every engine GPU, so every such GPU
receives the whole model once, pipelined over ``link_gbps`` (NVLink within a node, the nodes' network
across them); each engine rank then maps its own GPU's copy through CUDA IPC and copies its share at
device-copy speed) and
``sharded_p2p`` (``sync.transport=sharded``: each engine GPU receives only the slices it loads,
:func:`engine_rank_params`, from the trainer ranks holding them, every engine GPU over its own link at
once) and ``delta_sharded`` (both: each engine GPU receives the changed elements of its slices, after each
trainer rank compares the slices it holds, :func:`trainer_rank_params`, with its kept copy). ``path`` names
the one the recipe uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.config.errors import ConfigError
from megarl.planner.arch import Arch
from megarl.planner.lora import LoraPlan
from megarl.planner.params import (
    ShardedCount,
    attention_params,
    count_params,
    embedding_params,
    expert_params,
    head_params,
    layer_params,
)
from megarl.planner.units import dtype_bytes
from megarl.wire.weight_delta import MAX_GAP

MIB = 2**20
DELTA_CHANGE_FRACTION = 5e-4  # bf16 elements changed by one Adam step at RL learning rates (verl: 0.02-0.05%)
H2D_GBPS = 400.0  # host-to-device copy (pinned, PCIe Gen5 x16), Gbit/s: each stage's sender reads its kept copy
IPC_COPY_GBPS = 8000.0  # device-to-device copy on an H100/H200-class GPU, Gbit/s (~1 TB/s)


@dataclass(frozen=True)
class SyncPath:
    """One way a sync can go: ``seconds`` to move ``bytes`` (what crosses its links, per engine),
    ``inputs`` of its formula, ``built``: whether megarl has it."""

    bytes: int
    seconds: float
    formula: str
    inputs: dict
    built: bool = True


@dataclass(frozen=True)
class WeightSyncPlan:
    bytes_per_sync: int  # bytes one engine receives
    buckets: int  # buckets of at most bucket_mb MiB
    largest_tensor_bytes: int
    seconds: float  # transfer time at link_gbps
    payload: str = "model"  # model | adapter (LoRA adapters alone) | merged (the model with LoRA merged)
    path: str = "broadcast"  # the path the recipe uses (a key of paths)
    paths: dict[str, SyncPath] | None = None
    sync_seconds: dict[str, float] | None = None  # each path's seconds
    delta_host_bytes: int = 0  # sync.delta: host bytes of an engine rank's baseline (and of the senders' copies)


def largest_tensor_params(arch: Arch) -> int:
    """The largest single HF tensor: embedding/head, or one expert's gate/up/down projection."""
    return max(embedding_params(arch), head_params(arch), expert_params(arch) // 3)


def weight_sync_plan(arch: Arch, cfg: DictConfig, lora: LoraPlan | None = None) -> WeightSyncPlan:
    """``lora``: the recipe's adapters (:func:`megarl.planner.lora.lora_plan`), None without LoRA."""
    size = dtype_bytes(cfg.model.dtype)
    bucket = cfg.sync.bucket_mb * MIB
    if bucket <= 0 or cfg.sync.link_gbps <= 0:
        raise ConfigError(f"sync: bucket_mb and link_gbps must be > 0, "
                          f"got {cfg.sync.bucket_mb} and {cfg.sync.link_gbps}")
    if lora is not None and lora.sync == "adapter":
        nbytes, buckets, largest, payload = lora.synced_bytes, 1, lora.largest_tensor_bytes, "adapter"
    else:
        nbytes = count_params(arch).total * size
        buckets, largest = math.ceil(nbytes / bucket), largest_tensor_params(arch) * size
        payload = "model" if lora is None else "merged"
    rank_bytes = nbytes // cfg.rollout.engine_tp if payload == "adapter" else engine_rank_params(
        arch, cfg.rollout.engine_tp, 1 if cfg.rollout.engine_dp_attention else None) * size
    paths = sync_paths(nbytes, size, cfg, rank_bytes, trainer_rank_params(arch, cfg.parallel) * size)
    sharded = cfg.sync.transport == "sharded"
    path = ("colocated_ipc" if cfg.placement == "colocated" else
            ("delta_sharded" if sharded else "delta") if cfg.sync.delta else "sharded_p2p" if sharded else "broadcast")
    return WeightSyncPlan(bytes_per_sync=nbytes, buckets=buckets, largest_tensor_bytes=largest,
                          seconds=paths["broadcast"].seconds, payload=payload, path=path, paths=paths,
                          sync_seconds={name: p.seconds for name, p in paths.items()},
                          delta_host_bytes=(rank_bytes if sharded else nbytes) if cfg.sync.delta else 0)


def trainer_rank_params(arch: Arch, parallel) -> int:
    """Parameters one trainer rank holds (``parallel``: the config's ``parallel`` section): TP-split
    weights, embedding and head over ``tp``, routed experts over ``ep * etp``, replicated ones whole, each
    over the ``pp`` stages (evenly)."""
    counts = sum((layer_params(arch, i) for i in range(arch.num_layers)), ShardedCount())
    etp = parallel.etp or parallel.tp
    per_rank = ((counts.tp_split + embedding_params(arch) + head_params(arch)) / parallel.tp
                + counts.experts / (parallel.ep * etp) + counts.replicated + arch.hidden_size)
    return round(per_rank / parallel.pp)


def engine_rank_params(arch: Arch, engine_tp: int, attention_tp: int | None = None) -> int:
    """Parameters one rank of an engine of ``engine_tp`` ranks loads (what sharded resharding sends it,
    :mod:`megarl.sync.slices`): attention weights and the embedding over ``attention_tp`` ranks (default
    ``engine_tp``; 1 under full DP attention: each rank loads them whole), the other TP-split weights and
    the head over ``engine_tp``; routed experts over EP x MoE-TP = ``engine_tp``; replicated ones (norms,
    router, MLA down-projections) whole; K and V over ``min(kv_heads, attention_tp)`` ranks (SGLang
    replicates KV heads over the ranks when they are fewer)."""
    attention_tp = engine_tp if attention_tp is None else attention_tp
    counts = sum((layer_params(arch, i) for i in range(arch.num_layers)), ShardedCount())
    attention = attention_params(arch).tp_split * arch.num_layers
    split = counts.tp_split - attention + counts.experts + head_params(arch)
    per_rank = (split / engine_tp + (attention + embedding_params(arch)) / attention_tp + counts.replicated
                + arch.hidden_size)  # + the final norm
    if not arch.mla and arch.num_query_groups < attention_tp:
        kv = 2 * arch.hidden_size * arch.num_query_groups * arch.head_dim * arch.num_layers
        per_rank += kv / arch.num_query_groups - kv / attention_tp
    return round(per_rank)


def sharded_path(rank_bytes: int, nbytes: int, engine_tp: int, gbps: float) -> SyncPath:
    """``sharded_p2p``: each of the ``engine_tp`` engine ranks receives its ``rank_bytes`` over its own link,
    all at once; ``bytes`` is what crosses one engine's links."""
    return SyncPath(rank_bytes * engine_tp, rank_bytes * 8 / (gbps * 1e9), "bytes_per_engine_rank * 8 / link_gbps",
                    {"bytes_per_engine_rank": rank_bytes, "links": engine_tp, "model_bytes": nbytes,
                     "link_gbps": gbps})


def delta_wire_fraction(changed: float, element_size: int) -> float:
    """Bytes a delta sync moves over a whole sync's when a fraction ``changed`` of the elements changed
    (evenly spread, so steps between changes of about ``1 / changed``): per tensor the smallest of gaps
    (a 16-bit step + value per change, while the steps fit in 16 bits), sparse (int32 index + value),
    bitmap (one bit per element + value per change) and whole (:mod:`megarl.wire.weight_delta`)."""
    index_bytes = 2 if changed > 0 and 1 / changed <= MAX_GAP else 4
    return min(changed * (index_bytes + element_size), 1 / 8 + changed * element_size, element_size) / element_size


def sync_paths(nbytes: int, element_size: int, cfg: DictConfig, rank_bytes: int,
               trainer_rank_bytes: int) -> dict[str, SyncPath]:
    """Every path's projection for ``nbytes`` per engine, ``rank_bytes`` of them loaded by each engine rank,
    ``trainer_rank_bytes`` held by each trainer rank (see the module docstring)."""
    gbps = cfg.sync.link_gbps
    engine_gpus, stages = cfg.rollout.engine_tp, cfg.parallel.pp
    wire = delta_wire_fraction(DELTA_CHANGE_FRACTION, element_size)
    return {
        "broadcast": SyncPath(nbytes, nbytes * 8 / (gbps * 1e9), "bytes * 8 / link_gbps",
                              {"bytes": nbytes, "link_gbps": gbps}),
        "delta": SyncPath(int(nbytes * wire), (nbytes * wire * 8 / gbps + nbytes / stages * 8 / H2D_GBPS) / 1e9,
                          "bytes * wire_fraction * 8 / link_gbps + bytes / pp * 8 / h2d_gbps",
                          {"bytes": nbytes, "change_fraction": DELTA_CHANGE_FRACTION, "wire_fraction": wire,
                           "link_gbps": gbps, "pp": stages, "h2d_gbps": H2D_GBPS}),
        "colocated_ipc": SyncPath(nbytes, (nbytes * 8 / gbps + nbytes / engine_gpus * 8 / IPC_COPY_GBPS) / 1e9,
                                  "bytes * 8 / link_gbps + bytes / engine_gpus * 8 / ipc_copy_gbps",
                                  {"bytes": nbytes, "link_gbps": gbps, "engine_gpus": engine_gpus,
                                   "ipc_copy_gbps": IPC_COPY_GBPS}),
        "sharded_p2p": sharded_path(rank_bytes, nbytes, engine_gpus, gbps),
        "delta_sharded": SyncPath(
            int(rank_bytes * engine_gpus * wire),
            (rank_bytes * wire * 8 / gbps + trainer_rank_bytes * 8 / H2D_GBPS) / 1e9,
            "bytes_per_engine_rank * wire_fraction * 8 / link_gbps + trainer_rank_bytes * 8 / h2d_gbps",
            {"bytes_per_engine_rank": rank_bytes, "links": engine_gpus, "change_fraction": DELTA_CHANGE_FRACTION,
             "wire_fraction": wire, "link_gbps": gbps, "trainer_rank_bytes": trainer_rank_bytes, "h2d_gbps": H2D_GBPS}),
    }
