"""Where each rank runs: the node and device of every trainer rank and engine rank, and the
weight-sync groups between them.

Devices are counted across nodes (device ``g`` is device ``g % gpus_per_node`` of node
``g // gpus_per_node``, ``cluster.gpus_per_node``). Trainer rank ``i`` holds device ``i``.
The engine pools and their devices are the run's topology (:class:`megarl.config.topology.RunTopology`):
disaggregated engines follow the trainer's devices, engine by engine, rank by rank (no engine straddles
a node it fits in); colocated engines take the trainer's devices from device 0 (engine ``e``'s rank ``r``
on trainer rank ``e * engine_tp + r``'s device). The auxiliary engines (teacher, judge, frozen agent
roles) follow, on devices of their own in either placement.
An engine spans ``engine_tp`` devices, with or without DP attention (SGLang splits those ranks into
attention replicas; megarl runs one per rank).

The weight sync forms one group per pipeline stage: that stage's sending trainer rank (TP, CP and
DP rank 0: megatron-core orders ranks tp-cp-ep-dp-pp, so rank ``stage * world_size / pp``) and
every rank of every engine. The checks that a layout can be placed are made when the config loads
(:func:`megarl.config.topology.check_topology`, :class:`megarl.config.errors.PlacementError`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from megarl.config.topology import RunTopology


@dataclass(frozen=True)
class Device:
    node: int
    device: int  # the device's index on its node


@dataclass(frozen=True)
class SyncGroup:
    """One weight-sync group: the stage's sending trainer rank and every engine rank."""

    stage: int
    sender: int  # trainer rank
    engine_ranks: list[tuple[int, int]]  # (engine, rank within the engine)

    @property
    def size(self) -> int:
        return 1 + len(self.engine_ranks)


@dataclass(frozen=True)
class Segment:
    """Consecutive devices of one node holding consecutive ranks of the same holders (for reports):
    trainer ranks (and their pipeline stage) and/or the ranks of one engine; None where none."""

    node: int
    devices: tuple[int, int]  # first, last device index on the node
    trainer_ranks: tuple[int, int] | None
    stage: int | None
    engine: int | str | None  # a policy engine's index, or an auxiliary engine's name
    engine_ranks: tuple[int, int] | None


@dataclass(frozen=True)
class PlacementPlan:
    placement: str  # colocated | disaggregated
    gpus_per_node: int
    nodes: int
    pipeline_stages: int
    trainer: list[Device]  # by trainer rank
    engines: list[list[Device]]  # engines[e][r]: rank r of engine e
    sync_groups: list[SyncGroup]
    auxiliary: dict[str, list[Device]]  # auxiliary engine name -> its ranks' devices (never synced)

    def stage_of(self, rank: int) -> int:
        return rank // (len(self.trainer) // self.pipeline_stages)

    def segments(self) -> list[Segment]:
        """The placement as runs of devices (one row each in the report)."""
        holders: dict[tuple[int, int], list] = {}  # (node, device) -> [trainer rank, (engine, rank)]
        for i, d in enumerate(self.trainer):
            holders.setdefault((d.node, d.device), [None, None])[0] = i
        for e, devices in [*enumerate(self.engines), *self.auxiliary.items()]:
            for k, d in enumerate(devices):
                holders.setdefault((d.node, d.device), [None, None])[1] = (e, k)
        out: list[Segment] = []
        for (node, device), (rank, engine) in sorted(holders.items()):
            last = out[-1] if out else None
            if (last is not None and last.node == node and last.devices[1] == device - 1
                    and _continues(last.trainer_ranks, rank)
                    and (rank is None or self.stage_of(rank) == last.stage)
                    and (engine is None) == (last.engine is None)
                    and (engine is None or (engine[0] == last.engine and _continues(last.engine_ranks, engine[1])))):
                out[-1] = Segment(node, (last.devices[0], device),
                                  None if rank is None else (last.trainer_ranks[0], rank), last.stage,
                                  last.engine, None if engine is None else (last.engine_ranks[0], engine[1]))
            else:
                out.append(Segment(node, (device, device), None if rank is None else (rank, rank),
                                   None if rank is None else self.stage_of(rank),
                                   None if engine is None else engine[0],
                                   None if engine is None else (engine[1], engine[1])))
        return out

    def to_dict(self) -> dict:
        out = asdict(self)
        out["sync_groups"] = [dict(asdict(g), size=g.size) for g in self.sync_groups]
        return out


def _continues(run: tuple[int, int] | None, value: int | None) -> bool:
    return (run is None and value is None) or (run is not None and value == run[1] + 1)


def span(run: tuple[int, int] | None) -> str:
    """(3, 5) -> "3-5", (3, 3) -> "3", None -> "-"."""
    return "-" if run is None else str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}"


def ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def place(topology: RunTopology) -> PlacementPlan:
    """The node and device of every rank of ``topology`` (a loaded, hence checked, config's:
    :meth:`RunTopology.from_config`)."""
    gpn, policy = topology.gpus_per_node, topology.policy

    def at(g: int) -> Device:
        return Device(node=g // gpn, device=g % gpn)

    engines = [[at(g) for g in policy.engine_devices(e)] for e in range(policy.num_engines)]
    every_engine_rank = [(e, k) for e in range(policy.num_engines) for k in range(policy.tp)]
    per_stage = topology.trainer_ranks // topology.pipeline_stages
    groups = [SyncGroup(stage=s, sender=s * per_stage, engine_ranks=every_engine_rank)
              for s in range(topology.pipeline_stages)]
    auxiliary = {a.name: [at(g) for g in a.engine_devices(0)] for a in topology.auxiliary}
    return PlacementPlan(placement=topology.placement.value, gpus_per_node=gpn, nodes=topology.nodes,
                         pipeline_stages=topology.pipeline_stages,
                         trainer=[at(i) for i in range(topology.trainer_ranks)],
                         engines=engines, sync_groups=groups, auxiliary=auxiliary)
