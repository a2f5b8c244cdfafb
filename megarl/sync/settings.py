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
    group formation) may take before it fails. engine_tp: ranks per engine in the update group."""

    transport: str = "distributed"
    bucket_mb: float = 512
    work_dir: str = "weight_sync"
    timeout_s: float = 600.0
    engine_tp: int = 1

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"sync.transport={self.transport!r}: one of {TRANSPORTS}")
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
    def of(cls, settings) -> SyncSettings:
        """``settings`` itself, or the same fields read from any object that has them (e.g. the
        ``sync`` section of the config; fields it lacks keep their defaults)."""
        if isinstance(settings, cls):
            return settings
        names = ("transport", "bucket_mb", "work_dir", "timeout_s", "engine_tp")
        return cls(**{n: getattr(settings, n) for n in names if getattr(settings, n, None) is not None})
