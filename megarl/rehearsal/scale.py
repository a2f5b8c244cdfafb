"""The rule that scales a recipe's topology down to a few fake nodes while keeping its shape.

Kept: the placement (colocated or not), the number of pipeline stages (and virtual stages), context
parallelism where the smaller trainer divides by it, whether an engine is wider than a node, narrower
than one or exactly one, DP attention, the engines' expert parallelism as a share of their ranks, the
weight-sync transport, and a colocated run's share of the trainer's devices under engines. Shrunk:

- a node to ``NODE_GPUS`` GPUs (``cluster.gpus_per_node``; a recipe's smaller nodes stay as they are);
- an engine wider than a node spans ``min(its nodes, 2)`` nodes; a narrower one shares a node with
  ``min(engines per node, NODE_GPUS)`` engines; ``rollout.engine_tp`` follows;
- the engines to at most 2 (colocated), or to what the nodes left by the trainer hold (disaggregated);
- the trainer: colocated, as many ranks as the engines cover in the same share of them as the recipe's;
  disaggregated, ``min(its nodes, 2)`` whole nodes (a trainer smaller than a node shrinks by the node's
  factor); its tensor parallelism by the node's factor (at least 1, dividing a stage's ranks); expert
  parallelism 1 (it moves no rank to another node);
- never more than ``MAX_NODES`` nodes in all.

Not rehearsed: recipes written for the CPU (a ``model.dtype`` SGLang's GPU kernels do not compute in:
the suite runs those for real) and recipes with auxiliary engines (teacher, judge, frozen roles),
which this rule does not scale.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.engines.launch_plan import CUDA_DTYPES

NODE_GPUS = 2  # GPUs of a fake node
MAX_NODES = 4  # fake nodes of the rehearsal's cluster


@dataclass(frozen=True)
class Scaled:
    """A recipe's topology scaled down: its overrides and the nodes it needs."""

    overrides: tuple[str, ...]
    nodes: int


def not_rehearsable(cfg: DictConfig) -> str | None:
    """Why the rehearsal does not cover the loaded recipe ``cfg`` (None when it does)."""
    if cfg.model.dtype not in CUDA_DTYPES:
        return f"written for the CPU (model.dtype={cfg.model.dtype}): the suite runs it for real"
    if cfg.topology.auxiliary:
        return "has auxiliary engines (teacher, judge or frozen roles), which the scaling rule does not cover"
    return None


def _engines(tp: int, gpus_per_node: int, node_gpus: int) -> tuple[int, int]:
    """(scaled engine_tp, nodes one scaled engine spans) for an engine of ``tp`` ranks on nodes of
    ``gpus_per_node``."""
    if tp >= gpus_per_node:
        span = min(tp // gpus_per_node, 2)
        return span * node_gpus, span
    per_node = min(gpus_per_node // tp, node_gpus)
    return node_gpus // per_node, 1


def _divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` not above ``limit`` (at least 1)."""
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


def scale(cfg: DictConfig) -> Scaled:
    """The scaled-down topology of the loaded recipe ``cfg`` (see the module docstring)."""
    gpn, p, r = cfg.cluster.gpus_per_node, cfg.parallel, cfg.rollout
    node_gpus = min(gpn, NODE_GPUS)
    factor = gpn // node_gpus
    engine_tp, span = _engines(r.engine_tp, gpn, node_gpus)

    def engine_nodes(engines: int) -> int:
        return span * engines if span > 1 else math.ceil(engines * engine_tp / node_gpus)

    if cfg.placement == "colocated":
        engines = min(r.num_engines, 2)
        world = math.ceil(p.world_size * engines * engine_tp / (r.num_engines * r.engine_tp))
        nodes = max(math.ceil(world / node_gpus), engine_nodes(engines))
    else:
        trainer_nodes = min(math.ceil(p.world_size / gpn), 2)
        world = trainer_nodes * node_gpus if p.world_size >= gpn else max(1, p.world_size // factor)
        engines = r.num_engines
        while engines > 1 and trainer_nodes + engine_nodes(engines) > MAX_NODES:
            engines -= 1
        nodes = math.ceil(world / node_gpus) + engine_nodes(engines)
    cp = p.cp if world % (p.pp * p.cp) == 0 else 1
    tp = _divisor_at_most(world // (p.pp * cp), max(1, p.tp // factor))
    if nodes > MAX_NODES:
        raise ValueError(f"the scaled topology needs {nodes} nodes, more than the rehearsal's {MAX_NODES}")
    engine_ep = max(1, engine_tp * r.engine_ep // r.engine_tp)
    overrides = (f"cluster.gpus_per_node={node_gpus}", "cluster.num_nodes=null", f"parallel.world_size={world}",
                 f"parallel.tp={tp}", f"parallel.cp={cp}", "parallel.ep=1", f"rollout.num_engines={engines}",
                 f"rollout.engine_tp={engine_tp}", f"rollout.engine_ep={engine_ep}")
    return Scaled(overrides, nodes)
