"""Run a function on every rank of a trainer layout (gloo on CPU, NCCL on GPU).

The launcher for tests, tools, the warm-up and the converter. The ranks are the RL driver's:
:class:`megarl.trainer.actor.TrainerRank` Ray actors of a :class:`~megarl.trainer.actor.TrainerGroup`,
one process each. ``fn(rank, layout, *args)`` runs on every rank after
:func:`megarl.trainer.distributed.init_rank`; its return values come back in rank order.

``fn`` (and every argument) travels pickled, so it must be a module-level function of a module
the ranks can import: the directory that module was imported from is added to their
``sys.path`` (e.g. ``tests/`` for a test module's function). When Ray is not initialised,
:func:`run_ranks` starts a local Ray for the call and shuts it down after; otherwise it uses the
running one and removes only its own actors and placement group. The ranks' environment is the
Ray workers': the driver's at ``ray.init``.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import ray

from megarl.parallel import Layout


class RankFailed(RuntimeError):
    """A rank raised; the message holds its rank and traceback."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the header of a task's error


def _plain(error: Exception) -> str:
    return _ANSI.sub("", str(error))


def _import_root(obj) -> str | None:
    """The ``sys.path`` entry ``obj``'s module was imported from (None for ``__main__`` and builtins)."""
    name = getattr(obj, "__module__", None)
    module = sys.modules.get(name) if name else None
    file = getattr(module, "__file__", None)
    if module is None or file is None or name == "__main__":
        return None
    root = Path(file).resolve().parent
    for _ in range(name.count(".") + (Path(file).stem == "__init__")):
        root = root.parent
    return str(root)


def _start_ray(world_size: int) -> None:
    """Ray for this call: the cluster at ``RAY_ADDRESS`` when set, else a local one; the process's
    SIGTERM handler stays what it was (ray.init sets its own)."""
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    if os.environ.get("RAY_ADDRESS"):  # a cluster started for us (slurm/megarl.sbatch exports it): join it
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(num_cpus=max(2, world_size), include_dashboard=False, log_to_driver=False)
    if main and sigterm is not None:
        signal.signal(signal.SIGTERM, sigterm)


def run_ranks(fn: Callable[..., Any], layout: Layout, *args, backend: str = "auto", seed: int = 1234,
              timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn`` on ``layout.world_size`` trainer ranks; return their results by rank.

    Raises :class:`RankFailed` with the first failing rank's traceback (the other ranks are then
    stopped), or when the ranks neither return nor fail within ``timeout_s`` seconds (start-up
    included).
    """
    from megarl.trainer.actor import TrainerGroup

    deadline = time.monotonic() + timeout_s
    started = not ray.is_initialized()
    if started:
        _start_ray(layout.world_size)
    group = None
    try:
        paths = sorted({root for obj in (fn, *args) if callable(obj) for root in [_import_root(obj)] if root})
        try:
            group = TrainerGroup(layout, backend=backend, seed=seed, import_paths=paths, startup_timeout_s=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RankFailed(f"the ranks of {layout} did not start within {timeout_s:.0f} s") from None
        except ray.exceptions.RayError as e:
            raise RankFailed(f"the ranks of {layout} failed to start:\n{_plain(e)}") from None
        refs = group.run(fn, *args)
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        values: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RankFailed(f"ranks {sorted(rank_of[ref] for ref in pending)} gave no result within "
                                 f"{timeout_s:.0f} s")
            rank = rank_of[ready[0]]
            try:
                values[rank] = ray.get(ready[0])
            except ray.exceptions.RayError as e:
                raise RankFailed(f"rank {rank} of {layout} failed:\n{_plain(e)}") from None  # its traceback
        return [values[r] for r in range(layout.world_size)]
    finally:
        if group is not None:
            group.shutdown()
        if started:
            ray.shutdown()
