"""A trainer layout: how many ranks and how they split the model (TP/PP/CP/EP/DP)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """A trainer layout; world_size = tp * pp * cp * dp, experts split over ep * etp ranks."""

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    first_stage_layers: int | None = None  # uneven PP: decoder layers on the first / last stage
    last_stage_layers: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False

    @classmethod
    def from_config(cls, parallel) -> "Layout":
        return cls(world_size=parallel.world_size, tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp,
                   first_stage_layers=parallel.first_stage_layers, last_stage_layers=parallel.last_stage_layers,
                   cp=parallel.cp, ep=parallel.ep, etp=parallel.etp, sequence_parallel=parallel.sequence_parallel)
