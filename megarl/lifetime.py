"""A process that ends with the one that started it, even when that one is killed with SIGKILL.

Nothing runs in a process killed with SIGKILL, so what it started must watch it: the kernel does for a
child made with :func:`die_with_parent` (``PR_SET_PDEATHSIG``: SIGKILL when the thread that started it
exits); a driver started further down (through a shell, a launcher) watches the process named by
``OWNER_ENV`` (a pidfd: :func:`end_with_owner_from_env`). The test suite names each worker so: a killed
worker takes its drivers with it, and they take their runs (Ray ends a dead driver's actors, an SGLang
server ends with its engine actor: :mod:`megarl.engine_process.sglang_main`). A driver started by a user names no
owner and outlives its shell, as a long run should.
"""
from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import threading

log = logging.getLogger(__name__)

OWNER_ENV = "MEGARL_END_WITH_PID"  # a process id: the driver ends when that process does
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Looked up here, not in the forked child: a dlopen there could wait on a lock another thread held at the fork.
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_watching: set[int] = set()


def die_with_parent() -> None:
    """For ``subprocess.Popen(preexec_fn=...)``: the child gets SIGKILL when its parent's starting thread
    exits (Linux); OSError where the kernel refuses."""
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def end_with_owner_from_env() -> int | None:
    """When ``OWNER_ENV`` names another process, end this one with SIGKILL once that one exits (at once
    when it is gone already); the owner's pid, or None when there is none to watch. ValueError naming the
    variable when it is not a process id."""
    value = os.environ.get(OWNER_ENV)
    if not value:
        return None
    try:
        owner = int(value)
    except ValueError:
        raise ValueError(f"{OWNER_ENV}={value!r}: not a process id") from None
    if owner == os.getpid() or owner in _watching:
        return None
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        log.error("%s=%d: that process is gone; ending", OWNER_ENV, owner)
        os.kill(os.getpid(), signal.SIGKILL)
    _watching.add(owner)
    threading.Thread(target=_end_when_readable, args=(pidfd,), daemon=True, name="owner-watch").start()
    return owner


def _end_when_readable(pidfd: int) -> None:
    select.select([pidfd], [], [])  # readable once the process has exited
    os.kill(os.getpid(), signal.SIGKILL)
