"""Colocated engines pinned beside the trainer ranks whose devices they share.

The run's topology (:class:`megarl.config.topology.RunTopology`) gives colocated policy engine ``e``
the trainer's devices ``e * engine_tp`` onwards: its rank ``r`` shares trainer rank
:func:`shared_trainer_rank` ``(e, r)``'s device. Where those ranks really are is Ray's choice, known
once they run (their :class:`~megarl.parallel.places.Place`); :func:`colocated_seats` turns it into
one seat per node of the engine: the Ray node its server runs on (hard node affinity) and the GPUs
its ranks use there, in rank order (the server's ``CUDA_VISIBLE_DEVICES``; SGLang's
``--base-gpu-id`` 0 then counts within them). An engine wider than a node gets one seat per node,
each server on the node of its own ranks' devices.

The weight sync into colocated engines follows the same relation: the trainer rank on an engine
rank's device serves that rank its buckets (:mod:`megarl.sync.transports.tensor`).
"""
from __future__ import annotations

from collections.abc import Sequence

from megarl.parallel.places import Place


def shared_trainer_rank(engine: int, engine_rank: int, engine_tp: int) -> int:
    """The trainer rank whose device rank ``engine_rank`` of colocated policy engine ``engine`` (of
    ``engine_tp`` ranks) shares."""
    return engine * engine_tp + engine_rank


def colocated_seats(places: Sequence[Place], engine: int, engine_tp: int, nnodes: int) -> list[Place]:
    """The seats of colocated engine ``engine`` of ``engine_tp`` ranks over ``nnodes`` nodes, from
    ``places`` (every trainer rank's, by rank): node ``k``'s server on the node of its ranks' trainer
    ranks, with their GPUs in rank order. ValueError (naming the ranks and nodes) when the trainer
    ranks of one node's share sit on several nodes, when two shares sit on one node, or when they are
    not every one on a GPU of its own (or none on a GPU: a CPU run)."""
    per_node = engine_tp // nnodes
    first = shared_trainer_rank(engine, 0, engine_tp)
    if first + engine_tp > len(places):
        raise ValueError(f"engine {engine} of {engine_tp} ranks shares trainer ranks {first}-{first + engine_tp - 1}, "
                         f"but the trainer has {len(places)}")
    seats = []
    for k in range(nnodes):
        ranks = range(first + k * per_node, first + (k + 1) * per_node)
        nodes = {places[i].node_id for i in ranks}
        if len(nodes) != 1:
            where = ", ".join(f"rank {i} on {places[i].address}" for i in ranks)
            raise ValueError(f"engine {engine}'s node {k} shares the devices of trainer ranks {ranks[0]}-{ranks[-1]}, "
                             f"which Ray placed on several nodes ({where}): one engine node cannot use them")
        gpus = [g for i in ranks for g in places[i].gpus]
        if gpus and (len(gpus) != per_node or len(set(gpus)) != per_node):
            raise ValueError(f"engine {engine}'s node {k}: trainer ranks {ranks[0]}-{ranks[-1]} hold GPUs {gpus} on "
                             f"{places[ranks[0]].address}, not one each")
        seats.append(Place(places[ranks[0]].node_id, places[ranks[0]].address, tuple(gpus)))
    if len({s.node_id for s in seats}) != nnodes:
        raise ValueError(f"engine {engine} spans {nnodes} nodes, but the trainer ranks it shares sit on "
                         f"{sorted({s.address for s in seats})}")
    return seats
