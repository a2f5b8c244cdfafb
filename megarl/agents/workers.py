"""Agent workers: agent episodes run out of the driver, in Ray actors placed on any node
(``task.agent_workers``; 0 keeps them in the driver's event loop).

Each worker is a threaded Ray actor (``max_concurrency`` = ``episodes_per_worker``): an episode runs in
a thread of its own (:func:`megarl.agents.invoke.run_agent` under ``asyncio.run``), its OpenAI client
pointed over the network at the driver's gateway session with that session's credential; the agent's
tool work (CPU, subprocesses, blocking calls) runs there, so it stalls neither the driver nor the
worker's other episodes, and the workers' processes spread it over cores and nodes. What the agent
generated is recorded by the gateway, in the driver, exactly as in-driver episodes are: only the agent's
result (or its failure) comes back from the worker.

The worker imports the agent by its module and name (the driver's :func:`agent_spec`), with the
directory the driver imported it from added to its ``sys.path``: the module must be importable on every
node (the same image). A worker that cannot import it raises :class:`AgentWorkerError` in the driver (no
episode could run); a worker process that dies fails its episodes in flight as error kind
``worker_lost`` (counted; Ray restarts it, up to ``MAX_RESTARTS`` times).
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import pickle
import sys
import threading
from pathlib import Path

import ray

from megarl.agents.invoke import CANCEL_GRACE_S, Failure, run_agent
from megarl.agents.spec import AgentFn, AgentResult, load_agent
from megarl.tasks.prompts import Prompt

log = logging.getLogger(__name__)

MAX_RESTARTS = 3  # restarts of a worker process that died
_ANSWER_MARGIN_S = 30.0  # beyond the episode's timeout: a worker silent that long is wedged


class AgentWorkerError(RuntimeError):
    """A worker cannot run the agent at all (e.g. its module does not import on the worker's node)."""


def agent_spec(agent: AgentFn) -> tuple[str, str | None]:
    """``("package.module:function", the sys.path entry its module was imported from)`` of ``agent``;
    ValueError for a function a worker cannot import (defined in ``__main__`` or nested)."""
    module = sys.modules.get(agent.__module__)
    if agent.__module__ == "__main__" or module is None or "<locals>" in agent.__qualname__:
        raise ValueError(f"agent workers import the agent by name: {agent.__qualname__!r} of {agent.__module__!r} "
                         "must be a module-level function of an importable module")
    file = getattr(module, "__file__", None)
    if file is None:
        return f"{agent.__module__}:{agent.__qualname__}", None
    root = Path(file).resolve().parent
    for _ in range(agent.__module__.count(".") + (Path(file).stem == "__init__")):
        root = root.parent
    return f"{agent.__module__}:{agent.__qualname__}", str(root)


class AgentWorker:
    """One worker process's body (the Ray actor of :class:`AgentWorkers`); :meth:`run` is called from
    several threads at once, one episode each."""

    def __init__(self):
        self._agents: dict[str, AgentFn] = {}
        self._lock = threading.Lock()

    def run(self, spec: str, import_root: str | None, base_url: str, api_key: str, prompt: Prompt,
            timeout_s: float) -> tuple[AgentResult, Failure | None]:
        """One episode of the agent ``spec`` on the gateway session at ``base_url``: (result, None) or
        (None, (error kind, reason)), as :func:`~megarl.agents.invoke.run_agent`; a result that cannot travel
        back (not picklable) is ``malformed_result``."""
        agent = self._agent(spec, import_root)
        result, failure = asyncio.run(run_agent(agent, base_url, api_key, prompt, timeout_s))
        if failure is None:
            try:
                pickle.dumps(result)
            except Exception as e:  # noqa: BLE001 -- any pickling error: the result cannot be the episode's
                return None, ("malformed_result", f"agent returned {result!r:.80}, which cannot be sent back from "
                                                  f"its worker ({type(e).__name__}: {e}); expected a finite float, "
                                                  "a dict of them per role, or None")
        return result, failure

    def _agent(self, spec: str, import_root: str | None) -> AgentFn:
        with self._lock:
            if spec not in self._agents:
                if import_root is not None and import_root not in sys.path:
                    sys.path.append(import_root)
                    importlib.invalidate_caches()
                self._agents[spec] = load_agent(spec)
            return self._agents[spec]


class AgentWorkers:
    """``count`` agent worker processes (module docstring), each reserving ``cpus`` of Ray's CPUs, spread
    over the cluster's nodes, running up to ``episodes_per_worker`` episodes at once; an episode goes to
    the worker with the fewest in flight, and waits while every slot is taken. Needs a connected Ray.
    :meth:`aclose` ends the processes."""

    def __init__(self, count: int, cpus: float = 1.0, episodes_per_worker: int = 16):
        if count < 1 or episodes_per_worker < 1 or cpus < 0:
            raise ValueError(f"agent workers: count and episodes_per_worker must be >= 1 and cpus >= 0, got "
                             f"{count}, {episodes_per_worker}, {cpus}")
        if not ray.is_initialized():
            raise RuntimeError("agent workers are Ray actors: connect Ray first (ray.init)")
        actor = ray.remote(num_cpus=cpus, max_concurrency=episodes_per_worker, max_restarts=MAX_RESTARTS,
                           scheduling_strategy="SPREAD")(AgentWorker)
        self.actors = [actor.remote() for _ in range(count)]
        self.in_flight = [0] * count
        self._slots = asyncio.Semaphore(count * episodes_per_worker)

    async def run(self, agent: AgentFn, base_url: str, api_key: str, prompt: Prompt,
                  timeout_s: float) -> tuple[AgentResult, Failure | None]:
        """One episode of ``agent`` in a worker: as :func:`~megarl.agents.invoke.run_agent`, plus error kind
        ``worker_lost`` (the worker died) and ``timeout`` (a worker that did not answer in time)."""
        spec, root = agent_spec(agent)
        async with self._slots:
            i = min(range(len(self.actors)), key=self.in_flight.__getitem__)
            self.in_flight[i] += 1
            try:
                ref = self.actors[i].run.remote(spec, root, base_url, api_key, prompt, timeout_s)
                return await asyncio.wait_for(ref, timeout_s + CANCEL_GRACE_S + _ANSWER_MARGIN_S)
            except TimeoutError:
                return None, ("timeout", f"agent worker {i} did not answer within the episode's timeout of "
                                         f"{timeout_s:g} s")
            except ray.exceptions.RayActorError as e:
                return None, ("worker_lost", f"agent worker {i} died during the episode: {e}")
            except ray.exceptions.RayTaskError as e:
                raise AgentWorkerError(f"agent worker {i} cannot run {spec!r}: {e}") from e
            finally:
                self.in_flight[i] -= 1

    async def aclose(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
