"""What weight sync needs from a trainer: the calls of :class:`megarl.sync.rank.RankSync` on every rank.

:class:`WeightSyncTrainer` names the calls the driver makes, each running one ``RankSync`` method on every
rank, in the same order on all of them, and returning every rank's result in rank order. A trainer
implements them all at once: it subclasses :class:`WeightSyncTrainer` and implements
:meth:`~WeightSyncTrainer.on_ranks`, one generic call (:class:`megarl.trainer.actor.TrainerGroup` over its
Ray actors, ``tools/bench/weight_sync.py`` over one in-process rank). ``megarl.sync`` depends on this
protocol only, never on ``megarl.trainer``.
"""
from __future__ import annotations

from typing import Any, Literal, Protocol, get_args

from megarl.sync.buckets import BucketIndex
from megarl.sync.delta import DeltaPlan
from megarl.sync.report import SenderStats
from megarl.sync.transports.base import LinkSpec

# The RankSync methods a trainer runs on its ranks through one generic call. ``abort`` apart: it must reach a
# rank while another of its calls blocks (the trainer's actors run it in a concurrency group of its own).
RankCall = Literal["address", "connect", "disconnect", "begin", "next", "send", "finish"]
RANK_CALLS: tuple[str, ...] = get_args(RankCall)


class WeightSyncTrainer(Protocol):
    async def on_ranks(self, call: RankCall | Literal["abort"], *args: Any) -> list:
        """Every rank's result of ``RankSync.<call>(*args)``, rank order; ``abort`` reaches a rank while
        another of its calls blocks (waiting on a transfer stuck on a lost peer)."""
        raise NotImplementedError

    async def weight_sync_address(self) -> list[dict | None]:
        """Each stage sender's reserved ``{"stage", "host", "port", "backend"}`` (None off senders)."""
        return await self.on_ranks("address")

    async def weight_sync_connect(self, spec: LinkSpec) -> list[None]:
        """Every rank makes its half of the transport ``spec.kind``'s link."""
        return await self.on_ranks("connect", spec)

    async def weight_sync_disconnect(self, kind: str) -> list[None]:
        """Every rank closes its ``kind`` link."""
        return await self.on_ranks("disconnect", kind)

    async def weight_sync_begin(self, kind: str, version: int, capacity: int,
                                delta: DeltaPlan | None = None) -> list[None]:
        """Start a sync to ``version`` through ``kind`` with buckets of ``capacity`` bytes (in delta
        mode with a ``delta`` plan)."""
        return await self.on_ranks("begin", kind, version, capacity, delta)

    async def weight_sync_next(self) -> list[BucketIndex | None]:
        """Prepare each stage's next bucket: its index on the rank that reports it, None elsewhere or at the end."""
        return await self.on_ranks("next")

    async def weight_sync_send(self) -> list[Any]:
        """Start the transfer of each prepared bucket: the transport's payload where a rank has one, None
        elsewhere (and on the senders of stages that have sent their last bucket)."""
        return await self.on_ranks("send")

    async def weight_sync_finish(self) -> list[SenderStats | None]:
        """End the sync: each sending rank's :class:`SenderStats`, None elsewhere."""
        return await self.on_ranks("finish")

    async def weight_sync_abort(self) -> list[None]:
        """Drop a running sync and close every link."""
        return await self.on_ranks("abort")
