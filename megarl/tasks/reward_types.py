"""What a reward function is: ``async fn(RewardInput) -> float`` (:data:`RewardFn`), and what it sees
(:class:`RewardInput`). The rule rewards and the scorer are in :mod:`megarl.tasks.rewards`, the judge
in :mod:`megarl.tasks.judge`."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from megarl.sample import RolloutSample
from megarl.tasks.prompts import Prompt


@dataclass(frozen=True)
class RewardInput:
    """What a reward sees. ``response_text`` is the decoded response without special tokens;
    ``ended`` is True when generation stopped by itself (end-of-sequence or a stop string), False
    when it was cut by the length limit or an abort."""

    prompt: Prompt
    response_text: str
    ended: bool
    sample: RolloutSample


RewardFn = Callable[[RewardInput], Awaitable[float]]
