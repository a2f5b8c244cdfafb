"""Aborting a trainer rank's sync from another thread: a call waiting for a transfer's thread gives up
once the rank's abort event is set, leaving the transfer to its thread (bounded by the link)."""
from __future__ import annotations

import threading

POLL_S = 0.05  # how often a wait for a transfer checks for an abort


def wait_unless_aborted(thread: threading.Thread, aborting: threading.Event) -> bool:
    """Wait until ``thread`` ends (True) or ``aborting`` is set (False: the thread may still run)."""
    while thread.is_alive():
        if aborting.is_set():
            return False
        thread.join(POLL_S)
    return True
