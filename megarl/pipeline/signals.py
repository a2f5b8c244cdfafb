"""Stop requests: SIGTERM / SIGUSR1 from a scheduler, and Ctrl-C while the RL loop runs, end a run
cleanly after the current step."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Iterator

log = logging.getLogger(__name__)


class StopRequest:
    """SIGTERM / SIGUSR1 (SLURM's preemption and time-limit warnings) ask the run to stop: the RL
    loop checkpoints after the step in progress and exits. Installed once per process by the
    driver, before anything else starts, so a signal during start-up is not lost.

    Ctrl-C (SIGINT) asks the same while the RL loop runs (:meth:`ctrl_c_stops_after_the_step`); a
    second Ctrl-C goes to the handler that was there before (asyncio's: the run is cancelled at
    once, without a checkpoint). Outside the loop (warm-up, start-up: nothing to save yet) Ctrl-C
    interrupts at once, as it always does."""

    signal_name: str | None = None

    @classmethod
    def install(cls) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, cls._handle)

    @classmethod
    def _handle(cls, signum, frame) -> None:
        cls.signal_name = signal.Signals(signum).name
        log.warning("%s received: checkpoint after the current step, then exit", cls.signal_name)

    @classmethod
    @contextlib.contextmanager
    def ctrl_c_stops_after_the_step(cls) -> Iterator[None]:
        """Within the block the first SIGINT is a stop request; the next ones, and every SIGINT after
        the block, go to the handler from before it. Nothing changes off the main thread (signal
        handlers live there) or where SIGINT is ignored (``nohup``, a shell's background job)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGINT)
        if previous in (signal.SIG_IGN, None):
            yield
            return

        def on_sigint(signum, frame):
            if cls.signal_name is not None:  # asked already: stop now
                signal.signal(signal.SIGINT, previous)
                if callable(previous):
                    previous(signum, frame)
                else:
                    signal.raise_signal(signum)
                return
            cls.signal_name = "SIGINT"
            log.warning("Ctrl-C: checkpoint after the current step, then exit (Ctrl-C again: stop now, "
                        "without a checkpoint)")

        signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        finally:
            if signal.getsignal(signal.SIGINT) is on_sigint:
                signal.signal(signal.SIGINT, previous)
