"""Weight transports, one module each (``distributed``, ``tensor``, ``disk``, ``sharded``), behind
:mod:`megarl.sync.transports.base`'s interface, their process groups on the trainer's side in ``groups``.

:data:`REGISTRY` is the one place a transport is named: its name -> the factory of its
trainer-rank half (a :class:`~megarl.sync.link.RankLink`) and of its driver half (:class:`EngineSide`).
Each factory imports its module when called, so a transport's dependencies load only where it is used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megarl.sync.link import RankContext, RankLink
from megarl.sync.transports.base import EngineSide, LinkSpec, Sender


@dataclass(frozen=True)
class Transport:
    """``link(spec, rank)`` makes a trainer rank's half from the transport's :class:`LinkSpec` and the rank's
    :class:`~megarl.sync.link.RankContext` (on every rank); ``engine_side(settings)`` the driver's half from
    a :class:`megarl.sync.settings.SyncSettings`."""

    link: Callable[[LinkSpec, RankContext], RankLink]
    engine_side: Callable[[object], EngineSide]


def _distributed_link(spec, rank: RankContext) -> RankLink:
    from megarl.sync.stage_link import StageLink
    from megarl.sync.transports.distributed import DistributedSender

    def sender() -> Sender:
        if rank.address is None:
            raise RuntimeError("distributed weight sync: weight_sync_address must run before weight_sync_connect")
        return DistributedSender(spec, rank.stage, rank.address["host"], rank.address["port"])

    return StageLink(rank, sender)


def _distributed_engine_side(settings) -> EngineSide:
    from megarl.sync.transports.distributed import DistributedEngineSide

    return DistributedEngineSide(settings.timeout_s, settings.engine_tp)


def _tensor_link(spec, rank: RankContext) -> RankLink:
    from megarl.sync.transports.tensor import TensorLink

    return TensorLink(rank, spec)


def _tensor_engine_side(settings) -> EngineSide:
    from megarl.sync.transports.tensor import TensorEngineSide

    return TensorEngineSide(settings.engine_tp)


def _disk_link(spec, rank: RankContext) -> RankLink:
    from megarl.sync.stage_link import StageLink
    from megarl.sync.transports.disk import DiskSender

    return StageLink(rank, lambda: DiskSender(spec, rank.stage, rank.model.bridge.hf_pretrained.config))


def _disk_engine_side(settings) -> EngineSide:
    from megarl.sync.transports.disk import DiskEngineSide

    return DiskEngineSide(settings.work_dir)


def _sharded_link(spec, rank: RankContext) -> RankLink:
    from megarl.sync.sharded_rank import ShardedLink

    return ShardedLink(rank, spec)


def _sharded_engine_side(settings) -> EngineSide:
    from megarl.sync.transports.sharded import ShardedEngineSide

    return ShardedEngineSide(settings.timeout_s, settings.engine_tp)


REGISTRY: dict[str, Transport] = {
    "distributed": Transport(_distributed_link, _distributed_engine_side),
    "tensor": Transport(_tensor_link, _tensor_engine_side),
    "disk": Transport(_disk_link, _disk_engine_side),
    "sharded": Transport(_sharded_link, _sharded_engine_side),
}
TRANSPORTS = tuple(REGISTRY)  # the valid names of sync.transport


def _transport(name: str) -> Transport:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown weight transport {name!r}; one of {TRANSPORTS}") from None


def make_link(spec: LinkSpec, rank: RankContext) -> RankLink:
    """This trainer rank's half of ``spec.kind``'s link (collective where that transport's link is)."""
    return _transport(spec.kind).link(spec, rank)


def make_engine_side(settings) -> EngineSide:
    """The driver half for ``settings.transport`` (a :class:`megarl.sync.settings.SyncSettings`)."""
    return _transport(settings.transport).engine_side(settings)


__all__ = ["EngineSide", "LinkSpec", "REGISTRY", "Sender", "TRANSPORTS", "Transport", "make_engine_side", "make_link"]
