"""A bounded queue of scored prompt groups between the rollout producer and the trainer.

Depth is counted in groups (one prompt and its G samples). The producer reserves a slot before it
starts a group (:meth:`RolloutBuffer.reserve`), so generation never runs ahead of the bound and a
finished group always has room. The trainer takes the oldest groups first; a group whose
staleness exceeds ``max_staleness`` when taken is dropped and counted, never trained.

Staleness of a sample = trainer version - the oldest ``model_version`` of its response tokens
(docs/architecture.md, "Staleness"); the trainer version is the step whose weights the trainer holds.
"""
from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from megarl.pipeline.ledger import Ledger, Outcome
from megarl.sample import RolloutSample


def staleness(sample: RolloutSample, trainer_version: int) -> int:
    """How many weight versions the trainer is ahead of the oldest token of ``sample``."""
    oldest = int(sample.model_version.min()) if sample.model_version.size else trainer_version
    return trainer_version - oldest


@dataclass
class Group:
    """One prompt's scored samples. ``index`` is the prompt's draw position in the data stream."""

    index: int
    samples: list[RolloutSample]

    def staleness(self, trainer_version: int) -> int:
        return max(staleness(s, trainer_version) for s in self.samples)


@dataclass
class Taken:
    """What :meth:`RolloutBuffer.take` hands the trainer."""

    groups: list[Group]
    staleness: list[int]  # per trained sample
    dropped_stale: list[Group]

    @property
    def samples(self) -> list[RolloutSample]:
        return [s for g in self.groups for s in g.samples]


@dataclass
class Batch:
    """The prompt groups of one step, taken from the buffer, and how they came."""

    groups: list[Group]
    staleness: list[int]  # per sample, in weight versions
    wait_s: float  # how long the trainer waited for them

    @property
    def samples(self) -> list[RolloutSample]:
        return [s for g in self.groups for s in g.samples]


class RolloutBuffer:
    """Groups waiting for the trainer; at most ``capacity`` groups buffered or being generated."""

    def __init__(self, capacity: int, max_staleness: int | None, ledger: Ledger):
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1 group, got {capacity}")
        self.capacity, self.max_staleness, self.ledger = capacity, max_staleness, ledger
        self._groups: collections.deque[Group] = collections.deque()
        self._reserved = 0  # slots held by groups being generated
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def free(self) -> int:
        return self.capacity - len(self._groups) - self._reserved

    async def reserve(self) -> None:
        """Wait for a free slot and hold it for a group about to be generated."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.free > 0)
            self._reserved += 1

    async def release(self) -> None:
        """Give back a reserved slot whose group will not arrive (filtered, failed)."""
        async with self._changed:
            self._reserved -= 1
            self._changed.notify_all()

    async def put(self, group: Group) -> None:
        """Add a finished group into its reserved slot (the ledger has already counted it as buffered)."""
        async with self._changed:
            self._reserved -= 1
            self._groups.append(group)
            self._changed.notify_all()

    def groups(self) -> list[Group]:
        """The groups waiting for the trainer, oldest first."""
        return list(self._groups)

    def restore(self, groups: list[Group], reserved: int) -> None:
        """Put a checkpoint's ``groups`` back (the ledger, restored with them, counts them as buffered) and
        hold ``reserved`` slots for its groups in flight; before the producer starts."""
        self._groups.extend(groups)
        self._reserved += reserved

    async def take(self, num_groups: int, trainer_version: int) -> Taken:
        """The oldest ``num_groups`` groups fresh enough for ``trainer_version``; waits until there
        are that many. Stale groups met on the way are dropped and counted as ``dropped_stale``."""
        taken: list[Group] = []
        stale: list[Group] = []
        ages: list[int] = []
        while len(taken) < num_groups:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self._groups) > 0)
                group = self._groups.popleft()
                self._changed.notify_all()
            if self.max_staleness is not None and group.staleness(trainer_version) > self.max_staleness:
                self.ledger.left_buffer(len(group.samples), Outcome.DROPPED_STALE)
                stale.append(group)
                continue
            taken.append(group)
            ages += [staleness(s, trainer_version) for s in group.samples]
        for group in taken:
            self.ledger.left_buffer(len(group.samples), Outcome.TRAINED)
        return Taken(taken, ages, stale)
