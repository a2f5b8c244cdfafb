"""What rollout code needs from the engines: one client or a pool of them look the same."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from megarl.engines.types import BatchResult, SamplingParams, ServedModel
from megarl.sample import RolloutSample


class Engines(Protocol):
    """One engine (``SGLangClient``) or several (``EnginePool``) behind one generate call."""

    model: ServedModel

    async def generate_batch(self, prompts: list[list[int]], params: SamplingParams, *, group_ids: list[str],
                             return_routed_experts: bool = True, return_sampling_mask: bool = True,
                             affinity: Sequence[str | None] | None = None,
                             prefix_routes: Sequence[np.ndarray | None] | None = None) -> list[RolloutSample]:
        """One sample per prompt, in order. ``affinity[i]``: a key naming the requests that share prompt
        ``i``'s prefix (its group: they go where it went, see :mod:`megarl.engines.affinity`), or None.
        ``prefix_routes[i]``: the routes (integer [n, L, k]) prompt ``i``'s first n tokens were computed
        with, for the engine to replay (a resubmitted prefix), or None."""
        ...

    async def generate_batch_counted(self, prompts: list[list[int]], params: SamplingParams, *,
                                     group_ids: list[str], return_routed_experts: bool = True,
                                     return_sampling_mask: bool = True,
                                     affinity: Sequence[str | None] | None = None,
                                     prefix_routes: Sequence[np.ndarray | None] | None = None) -> BatchResult:
        """:meth:`generate_batch` that also says how many prompts were resubmitted."""
        ...
