"""The numbers of one weight sync."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class SyncReport:
    """One sync to ``version`` through ``transport`` into ``engines`` engines.

    bytes/buckets/tensors: what every engine received (summed over pipeline stages).
    Seconds per phase, summed over buckets (the phases overlap, so they do not add up to
    ``total_s``): ``gather_s`` pulling full HF tensors from the bridge's export (TP/EP gathers and
    the HF layout conversion) on the slowest stage's sender, ``convert_s`` packing them into bucket
    buffers there, ``send_s`` the sender's transfers, ``load_s`` the driver's wait for the engines
    to receive and load. ``total_s`` is pause to continue; ``gbps`` is bytes / total_s / 1e9.
    ``peak_bucket_bytes``: the most bucket memory alive at once on a sending rank.
    ``delta``: the buckets carried the changed elements only (``sync.delta``, engines at the trainer's
    previous version); in delta mode, ``elements`` of every tensor, ``changed_elements`` among them
    (all of them in a whole sync) and ``dense_bytes``, what the buckets would have held whole.
    ``bytes_per_engine_rank``: the most bytes one engine rank received (``bytes`` when every engine rank
    receives every bucket; ``sharded``: its slices only, counted by the senders per destination).
    """

    version: int
    transport: str
    engines: int
    bytes: int
    buckets: int
    tensors: int
    gather_s: float
    convert_s: float
    send_s: float
    load_s: float
    total_s: float
    peak_bucket_bytes: int
    largest_tensor_bytes: int
    delta: bool = False
    elements: int = 0
    changed_elements: int = 0
    dense_bytes: int = 0
    bytes_per_engine_rank: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def metrics(self, prefix: str = "sync/") -> dict[str, float]:
        """Flat numbers for metrics.jsonl."""
        out = {f"{prefix}{k}": float(v) for k, v in asdict(self).items() if k != "transport"}
        out[f"{prefix}gbps"] = self.gbps
        return out


@dataclass
class SenderStats:
    """One sending rank's numbers for one sync (seconds, bytes)."""

    stage: int
    bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    gather_s: float = 0.0
    convert_s: float = 0.0
    send_s: float = 0.0
    peak_bucket_bytes: int = 0
    largest_tensor_bytes: int = 0
    capacity: int = 0
    delta: bool = False  # the buckets carried changed elements (a delta-mode sync against a kept copy)
    elements: int = 0  # delta mode: elements of every tensor; the changed ones; the bytes sent whole
    changed_elements: int = 0
    dense_bytes: int = 0
    per_engine_rank: dict[int, int] = field(default_factory=dict)  # sharded: bytes sent to each engine rank


def most_bytes_per_engine_rank(stats: list[dict], whole: int) -> int:
    """The most bytes one engine rank received, from the senders' ``per_engine_rank`` counters summed over
    senders; ``whole`` (every rank receives every bucket) when no sender counted per rank."""
    per_rank: dict[int, int] = {}
    for s in stats:
        for rank, nbytes in s.get("per_engine_rank", {}).items():
            per_rank[rank] = per_rank.get(rank, 0) + nbytes
    return max(per_rank.values()) if per_rank else whole
