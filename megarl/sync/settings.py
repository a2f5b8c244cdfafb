"""What a :class:`megarl.sync.WeightSync` needs to know: transport, bucket size, work dir, timeout."""
from __future__ import annotations

from dataclasses import dataclass

from megarl.sync.transports import TRANSPORTS

MIB = 2**20


@dataclass(frozen=True)
class SyncSettings:
    """transport: distributed | tensor | disk. bucket_mb: bucket capacity in MiB (0: one tensor per
    bucket, i.e. one engine call per tensor). work_dir: the disk transport's checkpoints and the
    recovery checkpoints (visible to trainer and engines). timeout_s: the most one sync (and each
    group formation) may take before it fails. engine_tp: ranks per engine in the update group.
    Built from the config (:meth:`from_config`), whose schema holds the defaults."""

    transport: str
    bucket_mb: float
    work_dir: str
    timeout_s: float
    engine_tp: int

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"sync.transport: {self.transport!r} is not one of {', '.join(TRANSPORTS)}")
        if self.bucket_mb < 0:
            raise ValueError(f"sync.bucket_mb must be >= 0, got {self.bucket_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"sync.timeout_s must be > 0, got {self.timeout_s}")
        if self.engine_tp < 1:
            raise ValueError(f"engine_tp must be >= 1, got {self.engine_tp}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * MIB)

    @classmethod
    def from_config(cls, sync, engine_tp: int = 1) -> SyncSettings:
        """The settings of a config's ``sync`` section (``cfg.sync``; the schema,
        ``megarl.config.schema.SyncConfig``, holds the defaults) for engines of ``engine_tp`` ranks."""
        return cls(transport=sync.transport, bucket_mb=sync.bucket_mb, work_dir=sync.work_dir,
                   timeout_s=sync.timeout_s, engine_tp=engine_tp)
