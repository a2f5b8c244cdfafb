"""Weight transports, one module each, behind :mod:`megarl.sync.transports.base`'s interface.

:data:`REGISTRY` is the one place a transport is named: its name -> the factory of its
trainer-rank half (:class:`Sender`) and of its driver half (:class:`EngineSide`). Each factory
imports its module when called, so a transport's dependencies load only where it is used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megarl.sync.transports.base import EngineSide, Sender, SenderSpec


@dataclass(frozen=True)
class Transport:
    """``sender(spec, stage, hf_config, address)`` builds a sending rank's half (None: every trainer rank
    takes part, through its own module: ``sharded``, :mod:`megarl.sync.sharded_rank`);
    ``engine_side(settings)`` the driver's half from a :class:`megarl.sync.settings.SyncSettings`."""

    sender: Callable[[SenderSpec, int, Any, dict | None], Sender] | None
    engine_side: Callable[[Any], EngineSide]


def _distributed_sender(spec: SenderSpec, stage: int, hf_config, address: dict | None) -> Sender:
    from megarl.sync.transports.distributed import DistributedSender

    if address is None:
        raise RuntimeError("distributed weight sync: weight_sync_address must run before weight_sync_connect")
    return DistributedSender(spec, stage, address["host"], address["port"])


def _distributed_engine_side(settings) -> EngineSide:
    from megarl.sync.transports.distributed import DistributedEngineSide

    return DistributedEngineSide(settings.timeout_s, settings.engine_tp)


def _tensor_sender(spec: SenderSpec, stage: int, hf_config, address: dict | None) -> Sender:
    from megarl.sync.transports.tensor import TensorSender

    return TensorSender(spec)


def _tensor_engine_side(settings) -> EngineSide:
    from megarl.sync.transports.tensor import TensorEngineSide

    return TensorEngineSide(settings.engine_tp)


def _disk_sender(spec: SenderSpec, stage: int, hf_config, address: dict | None) -> Sender:
    from megarl.sync.transports.disk import DiskSender

    return DiskSender(spec, stage, hf_config)


def _disk_engine_side(settings) -> EngineSide:
    from megarl.sync.transports.disk import DiskEngineSide

    return DiskEngineSide(settings.work_dir)


def _sharded_engine_side(settings) -> EngineSide:
    from megarl.sync.transports.sharded import ShardedEngineSide

    return ShardedEngineSide(settings.timeout_s, settings.engine_tp)


REGISTRY: dict[str, Transport] = {
    "distributed": Transport(_distributed_sender, _distributed_engine_side),
    "tensor": Transport(_tensor_sender, _tensor_engine_side),
    "disk": Transport(_disk_sender, _disk_engine_side),
    "sharded": Transport(None, _sharded_engine_side),
}
TRANSPORTS = tuple(REGISTRY)  # the valid names of sync.transport


def _transport(name: str) -> Transport:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown weight transport {name!r}; one of {TRANSPORTS}") from None


def make_sender(spec: SenderSpec, stage: int, hf_config, address: dict | None) -> Sender:
    """The trainer-rank half for ``spec.kind``; ``address`` is the rank's reserved host/port
    (``distributed`` only), ``hf_config`` the model's HF config (``disk`` writes it)."""
    sender = _transport(spec.kind).sender
    if sender is None:
        raise ValueError(f"weight transport {spec.kind!r} has no stage sender: every trainer rank takes part")
    return sender(spec, stage, hf_config, address)


def make_engine_side(settings) -> EngineSide:
    """The driver half for ``settings.transport`` (a :class:`megarl.sync.settings.SyncSettings`)."""
    return _transport(settings.transport).engine_side(settings)


__all__ = ["EngineSide", "REGISTRY", "Sender", "SenderSpec", "TRANSPORTS", "Transport", "make_engine_side",
           "make_sender"]
