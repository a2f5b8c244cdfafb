"""The queue megatron-core's checkpoint writers report through, served by a process that ends with its owner.

megatron-core's ``torch_dist`` save (``dist_checkpointing/strategies/filesystem_async.py``,
``get_write_results_queue``) starts a ``multiprocessing`` Manager server (spawn) in the saving process on
its first save and keeps it for the process's life. A normal exit shuts it down; when the rank is
killed (SIGKILL: Ray ends its actors so, a driver killed by the OS or a user) the server is orphaned
and lives on, ~750 MB resident each. :func:`install` hands megatron the same kind of queue from a
Manager whose server watches its parent and exits once it is gone.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from multiprocessing.managers import SyncManager

PARENT_POLL_S = 1.0
_queue = None  # the queue made here (a proxy; it holds its Manager, whose server is ``_queue._manager._process``)


def _exit_when_orphaned(parent: int) -> None:
    """Manager-server initializer: a daemon thread ends the server once ``parent`` is no longer its parent."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-when-orphaned").start()


def install() -> None:
    """Make megatron-core's checkpoint writers (this process's) report through a queue whose Manager ends
    with this process, in place of megatron's own (made by an earlier save, if any); idempotent."""
    global _queue
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # megatron's start method
        manager.start(initializer=_exit_when_orphaned, initargs=(os.getpid(),))
        _queue = manager.Queue()
    filesystem_async._results_queue = _queue
