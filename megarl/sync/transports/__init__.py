"""Weight transports, one module each, behind :mod:`megarl.sync.transports.base`'s interface."""
from __future__ import annotations

from megarl.sync.transports.base import EngineSide, Sender, SenderSpec

TRANSPORTS = ("distributed", "tensor", "disk")


def make_sender(spec: SenderSpec, stage: int, hf_config, address: dict | None) -> Sender:
    """The trainer-rank half for ``spec.kind``; ``address`` is the rank's reserved host/port
    (``distributed`` only), ``hf_config`` the model's HF config (``disk`` writes it)."""
    if spec.kind == "distributed":
        from megarl.sync.transports.distributed import DistributedSender

        if address is None:
            raise RuntimeError("distributed weight sync: weight_sync_address must run before weight_sync_connect")
        return DistributedSender(spec, stage, address["host"], address["port"])
    if spec.kind == "tensor":
        from megarl.sync.transports.tensor import TensorSender

        return TensorSender(spec)
    if spec.kind == "disk":
        from megarl.sync.transports.disk import DiskSender

        return DiskSender(spec, stage, hf_config)
    raise ValueError(f"unknown weight transport {spec.kind!r}; one of {TRANSPORTS}")


__all__ = ["EngineSide", "Sender", "SenderSpec", "TRANSPORTS", "make_sender"]
