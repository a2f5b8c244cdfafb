"""Host memory that delta syncs (``sync.delta``) keep on each node, against the node's memory.

A delta sync compares what it sends with what it sent last, and each engine rank applies it to what it
loaded last: both ends keep host copies in ``model.dtype`` from the first delta sync on. Over
``distributed`` and ``tensor`` every engine rank keeps the whole model (each receives every bucket:
:mod:`megarl.engine_process.pipelined_load`) and each pipeline stage's sender its stage's share, pinned
(:mod:`megarl.sync.delta`); over ``sharded`` every engine rank keeps only the slices it loads
(:func:`megarl.planner.weight_sync.engine_rank_params`) and every trainer rank the slices it holds
(:func:`megarl.planner.weight_sync.trainer_rank_params`). A node's bytes are the copies of the ranks the
placement (:func:`megarl.planner.placement.place`) puts on it; they may take at most
:data:`DELTA_HOST_SHARE` of the node's host memory (``cluster.host_memory_gb``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.config.errors import fail
from megarl.planner.arch import Arch, resolve_arch
from megarl.planner.params import count_params
from megarl.planner.placement import place
from megarl.planner.units import GIB, dtype_bytes
from megarl.planner.weight_sync import engine_rank_params, trainer_rank_params

# The share of a node's host memory the delta copies may take: the rest holds the processes themselves
# (SGLang's schedulers, the trainer ranks with their optimizer offload), Ray's object store (30% of the
# memory by default) and the page cache the checkpoints load through.
DELTA_HOST_SHARE = 0.5


@dataclass(frozen=True)
class NodeCopies:
    """The delta copies one node holds: ``engine_ranks`` engine ranks of ``engine_rank_bytes`` each and
    ``trainer_ranks`` keeping ``trainer_rank_bytes`` each (the senders; every trainer rank over sharded)."""

    node: int
    engine_ranks: int
    engine_rank_bytes: int
    trainer_ranks: int
    trainer_rank_bytes: int

    @property
    def bytes(self) -> int:
        return self.engine_ranks * self.engine_rank_bytes + self.trainer_ranks * self.trainer_rank_bytes


def busiest_node(arch: Arch, cfg: DictConfig) -> NodeCopies:
    """The node holding the most bytes of delta copies under ``cfg`` (a loaded config with ``sync.delta``)."""
    size = dtype_bytes(cfg.model.dtype)
    model_bytes = count_params(arch).total * size
    plan = place(cfg.topology)
    if cfg.sync.transport == "sharded":
        attention_tp = 1 if cfg.rollout.engine_dp_attention else None
        engine_bytes = engine_rank_params(arch, cfg.rollout.engine_tp, attention_tp) * size
        trainer_bytes = trainer_rank_params(arch, cfg.parallel) * size
        keepers = range(len(plan.trainer))
    else:
        engine_bytes, trainer_bytes = model_bytes, model_bytes // cfg.parallel.pp
        keepers = [group.sender for group in plan.sync_groups]
    nodes = [NodeCopies(n, sum(d.node == n for ranks in plan.engines for d in ranks), engine_bytes,
                        sum(plan.trainer[k].node == n for k in keepers), trainer_bytes) for n in range(plan.nodes)]
    return max(nodes, key=lambda n: n.bytes)


def delta_memory_problem(node: NodeCopies, host_bytes: int, transport: str) -> str | None:
    """Why ``node``'s delta copies do not fit a node of ``host_bytes`` of host memory; None when they do."""
    if node.bytes <= DELTA_HOST_SHARE * host_bytes:
        return None
    parts = f"{node.engine_ranks} engine ranks x {node.engine_rank_bytes / GIB:.1f} GiB"
    if node.trainer_ranks:
        parts += f" + {node.trainer_ranks} trainer ranks x {node.trainer_rank_bytes / GIB:.1f} GiB"
    remedy = "sync.delta=false" if transport == "sharded" else \
        "sync.transport=sharded (each rank keeps only its slices) or sync.delta=false"
    return (f"delta syncs keep {node.bytes / GIB:.1f} GiB of host copies on node {node.node} ({parts}), over "
            f"{DELTA_HOST_SHARE:g} of its {host_bytes / GIB:.1f} GiB of host memory (cluster.host_memory_gb); use "
            f"{remedy}")


def check_delta_memory(cfg: DictConfig, host_bytes: int) -> None:
    """ConfigError naming ``sync.delta`` when its copies do not fit a node of ``host_bytes``; nothing
    without ``sync.delta``."""
    if not cfg.sync.delta:
        return
    why = delta_memory_problem(busiest_node(resolve_arch(cfg), cfg), host_bytes, cfg.sync.transport)
    if why is not None:
        fail("sync.delta", why)


def node_host_bytes(cfg: DictConfig) -> int:
    """A node's host memory: ``cluster.host_memory_gb``, else this machine's (the driver's node)."""
    if cfg.cluster.host_memory_gb is not None:
        return int(cfg.cluster.host_memory_gb * GIB)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
