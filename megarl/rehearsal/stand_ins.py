"""The processes the placement rehearsal runs where a GPU run's work would: a trainer rank that joins no
process group and builds no model (:class:`StandInRank`), and an engine server that loads nothing
(``python -m megarl.rehearsal.stand_in_server``). Both record what a GPU run depends on: their node, the
GPUs Ray gave them and ``CUDA_VISIBLE_DEVICES``, the NCCL environment, and (the server) its command line.

This module is imported by the stand-in ranks' Ray workers: it imports nothing heavy (no torch).
"""
from __future__ import annotations

import os

from megarl.parallel.nccl import pin_nccl_environment
from megarl.parallel.network import node_address, pin_gloo_interface
from megarl.parallel.places import Place, current_place

NCCL_PREFIX = "NCCL_"


def nccl_variables() -> dict[str, str]:
    """This process's ``NCCL_*`` environment variables."""
    return {k: v for k, v in os.environ.items() if k.startswith(NCCL_PREFIX)}


class StandInRank:
    """A trainer rank's stand-in (:attr:`megarl.trainer.actor.TrainerGroup.rank_class`): its :meth:`join`
    sets up the process as :func:`megarl.trainer.distributed.init_rank` does before its first process group
    (the run's NCCL settings, gloo's interface) and records where it runs, instead of joining the group."""

    def __init__(self):
        self.rank: int | None = None
        self._record: dict = {}

    def join(self, rank: int, layout, master_addr: str, master_port: int, backend: str, seed: int,
             import_paths=()) -> bool:
        """Record this rank; whether it reports the group's results (the last pipeline stage's TP, CP and DP
        rank 0: megatron-core orders ranks tp-cp-ep-dp-pp, so the stage's first rank)."""
        pin_nccl_environment()
        pin_gloo_interface()
        place = current_place()
        self.rank = rank
        self._record = {"rank": rank, "node_id": place.node_id, "address": place.address, "gpus": list(place.gpus),
                        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "nccl": nccl_variables(),
                        "master": f"{master_addr}:{master_port}"}
        return rank == (layout.pp - 1) * (layout.world_size // layout.pp)

    def place(self) -> Place:
        return current_place()

    def node_address(self) -> str:
        return node_address()

    def recorded(self) -> dict:
        """What :meth:`join` recorded."""
        return dict(self._record)
