"""Stop requests from the scheduler: SIGTERM / SIGUSR1 end a run cleanly after the current step."""
from __future__ import annotations

import logging
import signal

log = logging.getLogger(__name__)


class StopRequest:
    """SIGTERM / SIGUSR1 (SLURM's preemption and time-limit warnings) ask the run to stop: the RL
    loop checkpoints after the step in progress and exits. Installed once per process by the
    driver, before anything else starts, so a signal during start-up is not lost."""

    signal_name: str | None = None

    @classmethod
    def install(cls) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, cls._handle)

    @classmethod
    def _handle(cls, signum, frame) -> None:
        cls.signal_name = signal.Signals(signum).name
        log.warning("%s received: checkpoint after the current step, then exit", cls.signal_name)
