"""Run a function on every rank of a trainer layout, one process each (gloo on CPU, NCCL on GPU).

This is the plain-process launcher for tests, tools and the warm-up; the RL driver places the same
ranks as Ray actors. ``fn(rank, layout, master_port, *args)`` runs in a fresh spawned process
after :func:`megarl.trainer.distributed.init_rank`; its return values come back in rank order.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from typing import Any, Callable

from megarl.parallel import Layout, free_port


class RankFailed(RuntimeError):
    """A rank raised; the message holds its rank and traceback."""


def _rank_main(fn, rank, layout, port, backend, seed, args, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from megarl.log import setup_logging

    setup_logging()
    try:
        from megarl.trainer.distributed import init_rank, shutdown_rank

        init_rank(rank, layout, "127.0.0.1", port, backend=backend, seed=seed)
        value = fn(rank, layout, *args)
        results.put((rank, "ok", value))
        shutdown_rank()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], layout: Layout, *args, backend: str = "auto", seed: int = 1234,
              timeout_s: float = 600.0) -> list[Any]:
    """Spawn ``layout.world_size`` processes running ``fn``; return their results by rank.

    Raises :class:`RankFailed` with the first failing rank's traceback (the others are stopped),
    or when a rank neither returns nor fails within ``timeout_s`` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, layout, port, backend, seed, args, results), daemon=True)
             for r in range(layout.world_size)]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    try:
        while len(values) < layout.world_size:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise RankFailed(f"ranks {sorted(set(range(layout.world_size)) - set(values))} "
                                 f"gave no result within {timeout_s:.0f} s") from None
            if status == "error":
                raise RankFailed(f"rank {rank} of {layout} failed:\n{value}")
            values[rank] = value
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [values[r] for r in range(layout.world_size)]
