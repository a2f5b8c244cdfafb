"""The numbers of one weight sync."""
from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field, fields


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

    @classmethod
    def of(cls, stats: SenderStats, version: int, transport: str, engines: int, load_s: float,
           total_s: float) -> SyncReport:
        """The report of a sync whose senders' numbers are ``stats`` (merged: :meth:`SenderStats.merge`)."""
        counted = {f.name for f in fields(SenderStats)}
        return cls(version=version, transport=transport, engines=engines, load_s=load_s, total_s=total_s,
                   bytes_per_engine_rank=stats.most_bytes_per_engine_rank,
                   **{f.name: getattr(stats, f.name) for f in fields(cls) if f.name in counted})

    @property
    def gbps(self) -> float:
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def metrics(self, prefix: str = "sync/") -> dict[str, float]:
        """Flat numbers for metrics.jsonl."""
        out = {f"{prefix}{k}": float(v) for k, v in asdict(self).items() if k != "transport"}
        out[f"{prefix}gbps"] = self.gbps
        return out


def _summed_per_key(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in a.keys() | b.keys()}


def _merged_as(rule) -> dict:
    """A field's metadata: how :meth:`SenderStats.merge` combines two senders' values of it."""
    return {"merge": rule}


SUMMED, LARGEST, ANY = _merged_as(operator.add), _merged_as(max), _merged_as(operator.or_)


@dataclass
class SenderStats:
    """One sending rank's numbers for one sync (seconds, bytes); :meth:`merge` makes every sender's one
    sync's numbers: counts summed, seconds and sizes the largest (the senders run at once)."""

    stage: int = field(metadata=_merged_as(min))  # merged: the first stage
    bytes: int = field(default=0, metadata=SUMMED)
    buckets: int = field(default=0, metadata=SUMMED)
    tensors: int = field(default=0, metadata=SUMMED)
    gather_s: float = field(default=0.0, metadata=LARGEST)
    convert_s: float = field(default=0.0, metadata=LARGEST)
    send_s: float = field(default=0.0, metadata=LARGEST)
    peak_bucket_bytes: int = field(default=0, metadata=LARGEST)
    largest_tensor_bytes: int = field(default=0, metadata=LARGEST)
    capacity: int = field(default=0, metadata=LARGEST)
    # the buckets carried changed elements (a delta-mode sync against a kept copy)
    delta: bool = field(default=False, metadata=ANY)
    # delta mode: elements of every tensor; the changed ones; the bytes sent whole
    elements: int = field(default=0, metadata=SUMMED)
    changed_elements: int = field(default=0, metadata=SUMMED)
    dense_bytes: int = field(default=0, metadata=SUMMED)
    # bytes sent to each engine rank, counted by senders that do not send every bucket to every rank (sharded)
    per_engine_rank: dict[int, int] = field(default_factory=dict, metadata=_merged_as(_summed_per_key))

    def merge(self, other: SenderStats) -> SenderStats:
        """These numbers and ``other``'s as one sync's (each field as its metadata says)."""
        return SenderStats(**{f.name: f.metadata["merge"](getattr(self, f.name), getattr(other, f.name))
                              for f in fields(self)})

    @property
    def most_bytes_per_engine_rank(self) -> int:
        """The most bytes one engine rank received: the largest ``per_engine_rank`` count, else ``bytes``
        (every engine rank receives every bucket)."""
        return max(self.per_engine_rank.values(), default=self.bytes)
