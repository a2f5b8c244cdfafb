"""Run a function on every rank of a trainer layout (gloo on CPU, NCCL on GPU).

The launcher for tests, tools, the warm-up and the converter. The ranks are the RL driver's:
:class:`megarl.trainer.actor.TrainerRank` Ray actors of a :class:`~megarl.trainer.actor.TrainerGroup`,
one process each. ``fn(rank, layout, *args)`` runs on every rank after
:func:`megarl.trainer.distributed.init_rank`; its return values come back in rank order.

``fn`` (and every argument) travels pickled, so it must be a module-level function of a module
the ranks can import: the directory that module was imported from is added to their
``sys.path`` (e.g. ``tests/`` for a test module's function). Ray comes from :func:`ray_for_run`:
the caller's connection when Ray is initialised (only the call's own actors and placement group are
removed), else a cluster joined or started for the call. The ranks' environment is the Ray workers':
the driver's at ``ray.init``.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
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


# Ray's GCS keeps the events of its last RAY_task_events_max_num_task_in_gcs tasks (100,000 by default); a run's
# calls add about 20 kB a step to it, for days. A Ray that megarl starts keeps the last 1,000 (the calls of the
# last steps, what the dashboard shows) unless the environment names its own number (slurm/megarl.sbatch: the same).
TASK_EVENTS_KEPT_ENV, TASK_EVENTS_KEPT = "RAY_task_events_max_num_task_in_gcs", "1000"


@contextlib.contextmanager
def ray_for_run(num_cpus: int) -> Iterator[None]:
    """Ray for a run (a :func:`run_ranks` call, an RL pipeline) inside the block.

    When this process is already connected (a notebook's or a pytest worker's ``ray.init``), the run
    uses that connection and leaves it connected: it must remove what it created itself. Otherwise
    it joins the cluster at ``RAY_ADDRESS`` (slurm/megarl.sbatch exports it) or starts a local one of
    ``num_cpus`` logical CPUs (the run's actors; at least 2; its GCS keeps ``TASK_EVENTS_KEPT`` task
    events unless the environment sets ``TASK_EVENTS_KEPT_ENV``), and disconnects (stopping a local
    cluster) when the block ends. The process's SIGTERM handler stays what it was (``ray.init`` sets
    its own).
    """
    if ray.is_initialized():
        yield
        return
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        os.environ.setdefault(TASK_EVENTS_KEPT_ENV, TASK_EVENTS_KEPT)  # read by the GCS ray.init starts
        ray.init(num_cpus=max(2, num_cpus), include_dashboard=False, log_to_driver=False)
    if main and sigterm is not None:
        signal.signal(signal.SIGTERM, sigterm)
    try:
        yield
    finally:
        ray.shutdown()


def run_ranks(fn: Callable[..., Any], layout: Layout, *args, backend: str = "auto", seed: int = 1234,
              env: Mapping[str, str] | None = None, timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn`` on ``layout.world_size`` trainer ranks; return their results by rank. ``env``: variables
    set in the ranks' processes before they start (over the Ray workers' environment).

    Raises :class:`RankFailed` with the first failing rank's traceback (the other ranks are then
    stopped), or when the ranks neither return nor fail within ``timeout_s`` seconds (start-up
    included).
    """
    from megarl.trainer.actor import TrainerGroup

    deadline = time.monotonic() + timeout_s
    with ray_for_run(layout.world_size):
        group, done = None, False
        try:
            paths = sorted({root for obj in (fn, *args) if callable(obj) for root in [_import_root(obj)] if root})
            try:
                group = TrainerGroup(layout, backend=backend, seed=seed, import_paths=paths, env=env,
                                     startup_timeout_s=timeout_s)
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
            done = True
            return [values[r] for r in range(layout.world_size)]
        finally:
            if group is not None:
                group.shutdown(keep=done)  # after a failure a rank may be stuck in a collective
