"""What rollout code needs from the engines: one client or a pool of them look the same."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from megarl.sample import RolloutSample

if TYPE_CHECKING:  # the client implements this protocol and imports BatchResult from here
    from megarl.engines.client import SamplingParams, ServedModel


@dataclass(frozen=True)
class BatchResult:
    """The samples of one ``generate_batch`` call, in prompt order, and how many prompts of it had
    to be resubmitted because their engine died."""

    samples: list[RolloutSample]
    resubmitted: int


class Engines(Protocol):
    """One engine (``SGLangClient``) or several (``EnginePool``) behind one generate call."""

    model: ServedModel

    async def generate_batch(self, prompts: list[list[int]], params: SamplingParams, *, group_ids: list[str],
                             return_routed_experts: bool = True,
                             return_sampling_mask: bool = True) -> list[RolloutSample]:
        """One sample per prompt, in order."""
        ...

    async def generate_batch_counted(self, prompts: list[list[int]], params: SamplingParams, *,
                                     group_ids: list[str], return_routed_experts: bool = True,
                                     return_sampling_mask: bool = True) -> BatchResult:
        """:meth:`generate_batch` that also says how many prompts were resubmitted."""
        ...
