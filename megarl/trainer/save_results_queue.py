"""The queue megatron-core's checkpoint writers report through: an in-process one, no Manager process.

megatron-core's ``torch_dist`` save (``dist_checkpointing/strategies/filesystem_async.py``,
``get_write_results_queue``) reports its writers' results through a ``multiprocessing`` Manager queue,
whose server it starts (spawn: a fresh interpreter that re-imports the saving process's main module)
in the saving process on the first save and keeps for the process's life (a whole interpreter resident); when the
rank is killed (SIGKILL: Ray ends its actors so) that server is orphaned and lives on. A queue across
processes is needed only by an asynchronous save, whose writer runs in another process. megarl's
saves are synchronous (``save_checkpoint``): the writers are threads of the saving rank, which
``write_preloaded_data_multithread`` puts and ``retrieve_write_results`` takes from the same
process, so :func:`install` hands megatron a ``queue.Queue``: nothing to start, nothing to orphan.
"""
from __future__ import annotations

import queue

_queue: queue.Queue | None = None


def install() -> None:
    """Make megatron-core's checkpoint writers (this process's synchronous saves) report through an
    in-process queue, in place of megatron's Manager queue (made by an earlier save, if any); idempotent."""
    global _queue
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _queue is None:
        _queue = queue.Queue()
    filesystem_async._results_queue = _queue
