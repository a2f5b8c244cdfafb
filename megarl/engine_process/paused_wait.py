"""A paused scheduler waits on its sockets instead of spinning (installed on every platform).

SGLang 0.5.23's scheduler loops (``Scheduler.event_loop_normal``, ``event_loop_overlap`` and the
prefill/decode-disaggregated ones) go straight back to ``ingest_requests`` while the engine is
paused (``/pause_generation``), without the idle sleep that ``--sleep-on-idle`` gives an idle loop
(``on_idle`` -> ``maybe_sleep_on_idle``): for the whole weight sync, the scheduler burns a core
polling its sockets without a wait, the core that the server's HTTP process shares with it answers
the sync's control calls late (begin/end update, continue) and, colocated, the trainer loses it.

:func:`install` makes the paused loop wait the way the idle loop does: after SGLang's own
bookkeeping for a paused engine, a scheduler that has an idle sleeper (``--sleep-on-idle``, the
receiving rank) and no request left to dispatch blocks in ``IdleSleeper.maybe_sleep`` (a
``zmq.Poller`` on the tokenizer's and the RPC sockets, at most 1 s), so the next control request
(a weight load, continue) wakes it at once. Schedulers without a sleeper (the ranks that wait in the
broadcast from the receiving rank, a server started without ``--sleep-on-idle``) keep SGLang's loop.
"""
from __future__ import annotations

_original_record = None  # SGLang's Scheduler._record_scheduler_state_for_paused_engine, kept by install()


def record_and_wait(scheduler) -> None:
    """SGLang's bookkeeping for a paused engine, then the idle sleep when nothing waits to be dispatched."""
    _original_record(scheduler)
    if scheduler.idle_sleeper is not None and not scheduler._deferred_input_requests:
        scheduler.idle_sleeper.maybe_sleep()


def install() -> None:
    """Route the paused scheduler loop of this process through :func:`record_and_wait` (idempotent)."""
    global _original_record
    from sglang.srt.managers.scheduler import Scheduler

    if Scheduler._record_scheduler_state_for_paused_engine is record_and_wait:
        return
    _original_record = Scheduler._record_scheduler_state_for_paused_engine
    Scheduler._record_scheduler_state_for_paused_engine = record_and_wait
