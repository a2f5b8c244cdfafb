"""The rollouts a checkpoint carries: the buffer's scored groups and the partial groups in flight.

A checkpoint's data position (``trainer/checkpoint.py``: plain values only) holds them under
``carried``: each group's index and prompt, and every sample with its per-token records (tokens,
log-probs, versions, routes, sampling mask, mixed flags) in one base64 ``.npz``
(:func:`megarl.sample.samples_to_bytes`). A resumed run puts the buffered groups back in its buffer and
continues the partial ones from where they stopped (their aborted samples resubmitted with their
prefix and routes, :meth:`megarl.rollout.group.RolloutManager.generate_group`), so no token a
checkpoint recorded is generated again and no prompt is trained twice (docs/architecture.md,
"Accounting and resume").
"""
from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass

from megarl.pipeline.buffer import Group
from megarl.rollout.group import PartialGroup
from megarl.sample import samples_from_bytes, samples_to_bytes
from megarl.tasks.prompts import Prompt


@dataclass
class PartialEntry:
    """A group in flight at the checkpoint: its draw index, prompt and samples so far."""

    index: int
    prompt: Prompt
    group: PartialGroup


@dataclass
class CarriedRollouts:
    """What a checkpoint carries of the rollouts under way (see the module docstring)."""

    buffered: list[Group]
    partial: list[PartialEntry]

    @property
    def indices(self) -> set[int]:
        return {g.index for g in self.buffered} | {p.index for p in self.partial}

    def counts(self, samples_per_prompt: int) -> dict[str, tuple[int, int]]:
        """The ledger's items it holds: (in flight, buffered) prompts and sample attempts."""
        return {"prompts": (len(self.partial), len(self.buffered)),
                "samples": (len(self.partial) * samples_per_prompt, sum(len(g.samples) for g in self.buffered))}

    def to_plain(self, prompts: dict[int, Prompt]) -> dict:
        """The plain-typed form a checkpoint's data position holds; ``prompts``: each buffered group's prompt."""
        samples = [s for g in self.buffered for s in g.samples] + [s for p in self.partial for s in p.group.samples]
        return {
            "buffered": [[g.index, dataclasses.asdict(prompts[g.index]), len(g.samples)] for g in self.buffered],
            "partial": [[p.index, dataclasses.asdict(p.prompt), len(p.group.samples), p.group.resubmitted]
                        for p in self.partial],
            "samples": base64.b64encode(samples_to_bytes(samples)).decode("ascii"),
        }

    @classmethod
    def from_plain(cls, plain: dict) -> tuple[CarriedRollouts, dict[int, Prompt]]:
        """The carried rollouts of :meth:`to_plain`'s form and the buffered groups' prompts."""
        samples = iter(samples_from_bytes(base64.b64decode(plain["samples"])))
        buffered, prompts = [], {}
        for index, prompt, n in plain["buffered"]:
            buffered.append(Group(index, [next(samples) for _ in range(n)]))
            prompts[index] = Prompt(**prompt)
        partial = [PartialEntry(index, Prompt(**prompt), PartialGroup([next(samples) for _ in range(n)], resubmitted))
                   for index, prompt, n, resubmitted in plain["partial"]]
        return cls(buffered, partial), prompts
