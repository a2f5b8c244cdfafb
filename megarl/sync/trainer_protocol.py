"""What weight sync needs from a trainer: the per-rank calls of :class:`megarl.sync.rank.RankSync`.

:class:`megarl.trainer.actor.TrainerGroup` implements it over its Ray actors (one per Megatron
rank); ``tools/bench/weight_sync.py`` over one in-process rank. Every call runs on every rank, in
the same order on all of them, and returns every rank's result in rank order. ``megarl.sync``
depends on this protocol only, never on ``megarl.trainer``.
"""
from __future__ import annotations

from typing import Any, Protocol

from megarl.sync.buckets import BucketIndex
from megarl.sync.delta import DeltaPlan
from megarl.sync.report import SenderStats
from megarl.sync.transports.base import LinkSpec


class WeightSyncTrainer(Protocol):
    async def weight_sync_address(self) -> list[dict | None]:
        """Each stage sender's reserved ``{"stage", "host", "port", "backend"}`` (None off senders)."""

    async def weight_sync_connect(self, spec: LinkSpec) -> list[None]:
        """Every rank makes its half of the transport ``spec.kind``'s link."""

    async def weight_sync_disconnect(self, kind: str) -> list[None]:
        """Every sender closes its ``kind`` link."""

    async def weight_sync_begin(self, kind: str, version: int, capacity: int,
                                delta: DeltaPlan | None = None) -> list[None]:
        """Start a sync to ``version`` through ``kind`` with buckets of ``capacity`` bytes (in delta
        mode with a ``delta`` plan)."""

    async def weight_sync_next(self) -> list[BucketIndex | None]:
        """Gather and pack each stage's next bucket: its index on the sender, None elsewhere or at the end."""

    async def weight_sync_send(self) -> list[Any]:
        """Start the transfer of each packed bucket: the transport's payload on senders, None elsewhere
        (and on the senders of stages that have sent their last bucket)."""

    async def weight_sync_finish(self) -> list[SenderStats | None]:
        """End the sync: each sending rank's :class:`SenderStats`, None elsewhere."""

    async def weight_sync_abort(self) -> list[None]:
        """Drop a running sync and close every link."""
