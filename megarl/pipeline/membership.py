"""The policy engines over a run: engines lost, returned, joining and leaving, at the step boundary.

While the run goes, :meth:`megarl.engines.membership.EngineMembership.watch` probes the engines every
``rollout.engine_health_check_s`` and marks one lost after ``rollout.engine_lost_s`` of silence (its
requests go to the other engines).
Around each weight sync (:meth:`Membership.before_sync`, :meth:`Membership.after_sync`), never during a
training step, so that a full sync exports the weights of the version it names:

- before: leave requests are served (the file ``<run_dir>/leave_engines``, one engine a line: its URL
  or its node's address; each drains up to ``rollout.engine_drain_s`` and stops, and the pool's
  ceiling, ``rollout.max_engines``, goes down by one, so that it is not replaced), lost engines whose
  actor died with their node are stopped, and lost or gone engines leave the weight sync;
- after: lost engines that answer again rejoin, and an engine started on new capacity joins, each
  through a full sync (``pool.membership.on_restart``: :meth:`megarl.sync.WeightSync.recover`). New capacity is a
  free unit of the Ray cluster's engine resource (:func:`megarl.parallel.role_resources`) while the
  pool is below ``rollout.max_engines``; the engine starts in the background and joins at the first
  boundary after it is healthy.

``rollout/engines`` in each step's metrics is the number of engines taking prompts after the boundary.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from pathlib import Path
from urllib.parse import urlparse

from megarl.engines.membership import ACTIVE, GONE, LOST, EngineMembership
from megarl.engines.pool import EnginePool
from megarl.engines.server import EngineSettings
from megarl.parallel import role_resources

log = logging.getLogger(__name__)

LEAVE_FILE = "leave_engines"  # in the run directory: engines asked to leave, one URL or node address a line


@dataclasses.dataclass
class Membership:
    """The policy ``pool``'s membership for the weight ``sync`` (``WeightSync`` or ``AdapterSync``);
    ``template``: the settings engines that join start from; ``launch``: their ``start_engine`` keywords."""

    pool: EnginePool
    sync: object
    template: EngineSettings
    launch: dict
    run_dir: Path
    max_engines: int | None
    drain_s: float
    _joining: asyncio.Task | None = None
    _watch: asyncio.Task | None = None

    @property
    def _members(self) -> EngineMembership:
        return self.pool.membership

    def start(self, period_s: float, stack: contextlib.AsyncExitStack) -> None:
        """Probe the engines every ``period_s`` until ``stack`` closes (which also stops a join under way)."""
        self._watch = asyncio.create_task(self._members.watch(period_s))
        stack.push_async_callback(self._stop)

    async def _stop(self) -> None:
        for task in (self._watch, self._joining):
            if task is not None:
                task.cancel()
        if self._joining is not None:
            try:
                started = await self._joining
            except (asyncio.CancelledError, Exception):
                return
            await started.supervisor.stop(30.0)

    async def before_sync(self) -> None:
        """Serve leave requests, stop engines gone with their node, take lost ones out of the sync."""
        for index in self._leave_requests():
            try:
                await self._members.remove(index, self.drain_s)
            except ValueError as e:  # the last engine taking prompts stays
                log.warning("leave request refused: %s", e)
                continue
            if self.max_engines is not None:  # not replaced: the pool's ceiling goes down with it
                self.max_engines = max(1, self.max_engines - 1)
        for index in await self._members.gone(timeout_s=5.0):
            await self._members.discard(index, timeout_s=5.0)
        out = {c.base_url for c, s in zip(self._members.all_clients, self._members.states) if s in (LOST, GONE)}
        if any(c.base_url in out for c in self.sync.engines):
            self.sync.engines = [c for c in self.sync.engines if c.base_url not in out]
            await self.sync.close()  # the link is formed again, without them, at the next sync

    async def after_sync(self) -> dict[str, float]:
        """Returned engines rejoin, a started one joins, one more starts on free capacity; the metrics."""
        for index in self._members.returned():
            try:
                await self._members.rejoin(index)
            except Exception as e:  # still lost: tried again at the next boundary while it answers
                log.warning("engine %d did not rejoin: %s: %s", index, type(e).__name__, e)
        if self._joining is not None and self._joining.done():
            joining, self._joining = self._joining, None
            try:
                await self._members.admit(joining.result())
            except Exception as e:  # the start failed: the capacity is tried again at a later boundary
                log.warning("an engine did not join: %s: %s", type(e).__name__, e)
        if self._joining is None and self._room() and _free_engine_units() >= self.template.nnodes:
            settings = dataclasses.replace(self.template, host=None, port=None, log_path=self._log_path())
            self._joining = asyncio.ensure_future(EngineMembership.start_engine(settings, **self.launch))
            log.info("free engine capacity in the Ray cluster: starting engine %d", len(self._members.states))
        return {"rollout/engines": float(self.pool.size)}

    async def sync_engine_lost(self, period_s: float = 0.5) -> None:
        """Return once an engine of the weight sync's set is lost (checked every ``period_s``)."""
        while True:
            synced = {c.base_url for c in self.sync.engines}
            if any(c.base_url in synced and s in (LOST, GONE)
                   for c, s in zip(self._members.all_clients, self._members.states)):
                return
            await asyncio.sleep(period_s)

    def _room(self) -> bool:
        return self.max_engines is not None and self.pool.size < self.max_engines

    def _log_path(self) -> str | None:
        if self.template.log_path is None:
            return None
        return f"{self.template.log_path}.joined{len(self._members.states)}"

    def _leave_requests(self) -> list[int]:
        """The active engines named in the leave file (removed once read); names that match none are logged."""
        path = self.run_dir / LEAVE_FILE
        if not path.is_file():
            return []
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        path.unlink()
        found = []
        for name in names:
            matches = [i for i, (c, s) in enumerate(zip(self._members.all_clients, self._members.states))
                       if s == ACTIVE and name in (c.base_url, urlparse(c.base_url).hostname)]
            if not matches:
                log.warning("%s: %r names no engine taking prompts (engines: %s)", path, name,
                            [c.base_url for c in self.pool.clients])
            found += [i for i in matches if i not in found]
        return found


def _free_engine_units() -> float:
    """Free units of the engine resource in the Ray cluster (0 when no node offers it)."""
    import ray

    names = list(role_resources("engine"))
    return ray.available_resources().get(names[0], 0.0) if names else 0.0
