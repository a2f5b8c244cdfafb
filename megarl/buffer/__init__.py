"""The rollout buffer between generation and training, its staleness policy and sample accounting."""
from megarl.buffer.accounting import Ledger, Outcome
from megarl.buffer.rollout_buffer import Group, RolloutBuffer, Taken, staleness

__all__ = ["Group", "Ledger", "Outcome", "RolloutBuffer", "staleness", "Taken"]
