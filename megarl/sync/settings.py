"""What a :class:`megarl.sync.WeightSync` needs to know: the config's ``sync`` section (its schema node,
:class:`SyncConfig`) and the ranks of the engines it updates (:class:`SyncSettings`)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from megarl.fields import check_bounds, setting
from megarl.sync.transports import TRANSPORTS

MIB = 2**20


@dataclass(frozen=True)
class SyncConfig:
    # auto (tensor when colocated, else distributed) | distributed | tensor | disk | sharded (each engine rank
    # receives only the slices it loads, point to point from the trainer ranks holding them; parallel.pp=1)
    transport: str = setting("auto", choices=("auto", *TRANSPORTS))
    bucket_mb: int = setting(512, ge=0)  # MiB per bucket (0: one engine call per tensor)
    link_gbps: float = setting(400.0, gt=0)  # planner: trainer->engine link bandwidth, Gbit/s
    work_dir: str = "${logging.run_dir}/weight_sync"  # disk transport, recovery checkpoints (seen by trainer + engines)
    # a sync running longer fails (WeightSyncError) and leaves the engines consistent
    timeout_s: float = setting(600.0, gt=0)
    # send only the elements changed since the engines' version (megarl/sync/delta.py); any transport but disk
    delta: bool = False
    # a bucket whose delta exceeds this fraction of its bytes travels whole
    delta_max_fraction: float = setting(0.5, gt=0, le=1)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * MIB)


@dataclass(frozen=True)
class SyncSettings(SyncConfig):
    """A :class:`SyncConfig` (``transport`` resolved: distributed | tensor | disk | sharded; ``bucket_mb`` 0: one
    tensor per bucket, i.e. one engine call per tensor; ``timeout_s`` also bounds each group formation)
    for engines of ``engine_tp`` ranks (the ranks per engine in the update group)."""

    engine_tp: int = setting(1, ge=1)

    def __post_init__(self):
        check_bounds(self, "sync.")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"sync.transport: {self.transport!r} is not one of {', '.join(TRANSPORTS)}")
        if self.delta and (why := delta_refusal(self.transport)) is not None:
            raise ValueError(f"sync.delta: {why}")

    @classmethod
    def from_config(cls, sync, engine_tp: int = 1) -> SyncSettings:
        """The config's ``sync`` section (``cfg.sync``) for engines of ``engine_tp`` ranks."""
        return cls(**{f.name: getattr(sync, f.name) for f in fields(SyncConfig)}, engine_tp=engine_tp)


def delta_refusal(transport: str, lora_sync: str | None = None) -> str | None:
    """Why ``sync.delta`` cannot run with resolved ``transport`` and LoRA synced as ``lora_sync`` (None:
    no LoRA); None when it can."""
    if transport == "disk":
        return ("the disk transport writes whole checkpoints that the engines load from disk; delta syncs "
                "go through sync.transport=distributed, tensor or sharded")
    if lora_sync == "adapter":
        return ("lora.sync=adapter moves the adapters alone (already a small fraction of the model); delta "
                "syncs apply to whole weights, e.g. lora.sync=merged")
    return None
