"""A trainer rank's half of one transport's link: the calls every sync mode implements.

:class:`megarl.sync.rank.RankSync` holds a rank's links, one per transport (made by the transport's
entry in :data:`megarl.sync.transports.REGISTRY` from its spec and the rank's :class:`RankContext`), and runs
one sync at a time through one of them, without knowing which: ``begin``, then ``next``/``send`` until
``next`` reports the end on every rank, then ``finish`` (or ``abort``). Every rank of the trainer makes
the same calls in the same order, so a link may run collectives in any of them. The sync modes:

- the stage path (:class:`megarl.sync.stage_link.StageLink`): every rank of a pipeline stage gathers the
  stage's HF tensors, its sending rank packs them into buckets and hands them to one transport
  :class:`~megarl.sync.transports.base.Sender` (``distributed``, ``disk``; ``tensor`` adds a fan-out of each
  bucket to the ranks that feed the colocated engines: :class:`megarl.sync.transports.tensor.TensorLink`);
- the sharded path (:class:`megarl.sync.sharded_rank.ShardedLink`): every rank sends its own slices.
"""
from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import Any

from megarl.sync.buckets import BucketIndex
from megarl.sync.delta import DeltaPlan
from megarl.sync.report import SenderStats


@dataclass(frozen=True)
class RankContext:
    """What a link needs from the trainer rank it runs on: the rank's
    :class:`megarl.models.bridge.MegatronModel`, its pipeline stage, whether it is its stage's sending
    rank, the host/port it reserved for its stage's group (``RankSync.address``; None off senders or
    before), and the event an abort sets (a call waiting on a transfer gives up when it is set)."""

    model: Any
    stage: int
    is_sender: bool
    address: dict | None
    aborting: threading.Event


class RankLink(abc.ABC):
    """One transport's link on one trainer rank, and the state of the sync running through it."""

    @abc.abstractmethod
    def begin(self, version: int, capacity: int, delta: DeltaPlan | None) -> None:
        """Start a sync to ``version`` in buckets of ``capacity`` bytes; in delta mode with a ``delta`` plan
        (:mod:`megarl.sync.delta`)."""

    @abc.abstractmethod
    def next(self) -> BucketIndex | None:
        """Prepare the next bucket; its index on the rank the driver takes it from, None elsewhere and at
        the end."""

    @abc.abstractmethod
    def send(self) -> Any:
        """Start the transfer of the bucket ``next`` prepared; the payload the driver hands to the
        transport's :class:`~megarl.sync.transports.base.EngineSide` (None where this rank has none)."""

    @abc.abstractmethod
    def finish(self) -> SenderStats | None:
        """Wait for the last transfer and end the sync (ended also when it raises); this rank's numbers
        where it sends, else None."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop the running sync at once: a transfer in progress is left to its thread, which the link's
        bound ends; WeightSyncError when a transfer had failed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the link (never waits for engines, which may be gone)."""
