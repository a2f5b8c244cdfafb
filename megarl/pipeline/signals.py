"""Stop requests: SIGTERM / SIGUSR1 from a scheduler, and Ctrl-C while the RL loop runs, end a run
cleanly after the current step; during start-up they end it at once."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import Callable, Iterator

log = logging.getLogger(__name__)


class StopRequest:
    """SIGTERM / SIGUSR1 (SLURM's preemption and time-limit warnings) ask the run to stop: the RL
    loop checkpoints after the step in progress and exits. Installed once per process by the
    driver, before anything else starts, so a signal during start-up is not lost.

    Ctrl-C (SIGINT) asks the same while the RL loop runs (:meth:`ctrl_c_stops_after_the_step`); a
    second Ctrl-C goes to the handler that was there before (asyncio's: the run is cancelled at
    once, without a checkpoint). Outside the loop (warm-up, start-up: nothing to save yet) Ctrl-C
    interrupts at once, as it always does.

    During start-up (:meth:`cancels_the_start_up`) SIGTERM / SIGUSR1 cancel it at once: nothing is
    trained yet, and loading a big model takes minutes, more than a scheduler waits after SIGTERM
    (SLURM's KillWait: 30 s by default) before it kills the job, and its requeue with it."""

    signal_name: str | None = None
    _on_request: Callable[[], None] | None = None

    @classmethod
    def install(cls) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, cls._handle)

    @classmethod
    def _handle(cls, signum, frame) -> None:
        cls.signal_name = signal.Signals(signum).name
        if cls._on_request is not None:
            log.warning("%s received during start-up: stopping now (nothing to save yet)", cls.signal_name)
            cls._on_request()
        else:
            log.warning("%s received: checkpoint after the current step, then exit", cls.signal_name)

    @classmethod
    @contextlib.contextmanager
    def cancels_the_start_up(cls) -> Iterator[None]:
        """Within the block (entered by a coroutine), a stop request, or one that came before it,
        cancels the task that entered it: ``asyncio.CancelledError`` at its next ``await``."""
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        cls._on_request = lambda: loop.call_soon_threadsafe(task.cancel)
        try:
            if cls.signal_name is not None:
                task.cancel()
            yield
        finally:
            cls._on_request = None

    @classmethod
    @contextlib.contextmanager
    def ctrl_c_stops_after_the_step(cls) -> Iterator[None]:
        """Within the block the first SIGINT is a stop request; the next ones, and every SIGINT after
        the block, go to the handler from before it. Nothing changes off the main thread (signal
        handlers live there) or where SIGINT is ignored (``nohup``, a shell's background job)."""
        on_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGINT) if on_main_thread else None
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
