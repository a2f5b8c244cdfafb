"""How the RL modes differ: how far generation may run ahead of training, and the buffer's depth.

=============  =================================  ==========================================
mode           lag (weight versions)              capacity (prompt groups)
=============  =================================  ==========================================
sync           0 (a batch from the last weights)  prompts_per_step
one_step_off   1                                  prompts_per_step
async          buffer.max_staleness               buffer.max_buffer_batches * prompts_per_step
=============  =================================  ==========================================
"""
from __future__ import annotations

from omegaconf import DictConfig

from megarl.engines.types import PauseMode

PAUSE_FOR_PARTIAL_ROLLOUT = {"continue": PauseMode.RETRACT, "abort_resubmit": PauseMode.ABORT,
                             "in_place": PauseMode.IN_PLACE}


def lag_and_capacity(cfg: DictConfig) -> tuple[int, int, int]:
    """(lag in weight versions, buffer capacity in groups, max staleness) of ``cfg.mode``."""
    p, b = cfg.rollout.prompts_per_step, cfg.buffer
    if cfg.mode == "sync":
        return 0, p, 0
    if cfg.mode == "one_step_off":
        return 1, p, 1
    return b.max_staleness, b.max_buffer_batches * p, b.max_staleness
