"""The numbers of one weight sync."""
from __future__ import annotations

from dataclasses import asdict, dataclass


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

    @property
    def gbps(self) -> float:
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def metrics(self, prefix: str = "sync/") -> dict[str, float]:
        """Flat numbers for metrics.jsonl."""
        out = {f"{prefix}{k}": float(v) for k, v in asdict(self).items() if k != "transport"}
        out[f"{prefix}gbps"] = self.gbps
        return out
