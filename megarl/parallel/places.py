"""Where a process of a run sits: its Ray node and the GPUs Ray gave it.

A trainer rank reports its :class:`Place` (:func:`current_place`, inside its Ray actor); colocated
engines are pinned to the places of the trainer ranks whose devices they share
(:func:`megarl.engines.pinning.colocated_seats`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    """One process's seat: ``node_id`` (Ray's node id), ``address`` (the node's routable address,
    :func:`megarl.parallel.node_address`) and ``gpus``: the GPU ids Ray assigned to the process, as the
    node's ``CUDA_VISIBLE_DEVICES`` names them (empty on a CPU process)."""

    node_id: str
    address: str
    gpus: tuple[str, ...] = ()


def current_place() -> Place:
    """This process's :class:`Place` (in a Ray driver or worker; outside Ray: node id ``""``, no GPUs)."""
    import ray

    from megarl.parallel.network import node_address

    if not ray.is_initialized():
        return Place("", node_address())
    context = ray.get_runtime_context()
    gpus = tuple(str(g) for g in context.get_accelerator_ids().get("GPU", []))
    return Place(context.get_node_id(), node_address(), gpus)
