"""A Ray actor that owns one SGLang server: starts it, watches it, restarts it when it dies, stops it.

The watchdog is process liveness, polled every ``poll_interval_s``: the server's leader process
and the scheduler/detokenizer children it had once healthy. SGLang's ``/health`` and
``/health_generate`` are not used: both generate a probe token (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``
is on by default) and answer 503 whenever the engine is paused, so a watchdog built on them would
restart engines during every weight sync. When a client found the engine unreachable,
``ensure_healthy`` also asks ``/model_info`` (answered while paused): a process still tearing down
after a crash is waited for, and one that lives but does not answer for ``unresponsive_restart_s``
is restarted as hung. A restart reuses the port, so
the URL and every client of the engine stay valid; it loads the launch checkpoint and version (the
engine pool then brings it to the current weights, see :mod:`megarl.engines.pool`), and after
``max_restarts`` failed or repeated restarts the actor gives up and reports the engine failed.

The actor runs threaded (``max_concurrency``): ``ensure_healthy`` may block for a restart while
``info`` keeps answering.

An engine wider than a node (``settings.nnodes`` > 1: SGLang's ``--nnodes``) has one server per
node. The actor is its node 0, which serves HTTP; it starts a follower actor on each other node,
in the bundles 1.. of the engine's placement group (:func:`engine_nodes`, one bundle a node; its
owner, the engine pool, removes it), or, for a colocated engine pinned beside its trainer ranks, on
the nodes of its seats 1.. (:mod:`megarl.engines.pinning`), each running the same server with its
``--node-rank`` against node 0's ``--dist-init-addr`` (an address and port of node 0, fresh at every
start). The followers do not restart on their own: any node's death is the engine's, and the restart
starts every node again.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

import httpx
import psutil

from megarl.engines.client import auth_headers
from megarl.engines.server import EngineDiedError, EngineSettings, EngineStartError, SGLangEngine
from megarl.parallel import free_port, node_address, pin_gloo_interface, rendezvous_host, role_resources

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchdogSettings:
    """How an :class:`EngineActor` watches its server (module docstring): liveness polled every
    ``poll_interval_s`` seconds, a server silent for ``unresponsive_restart_s`` restarted, at most
    ``max_restarts`` restarts before the engine is reported failed."""

    poll_interval_s: float = 0.5
    max_restarts: int = 3
    unresponsive_restart_s: float = 60.0


DEFAULT_WATCHDOG = WatchdogSettings()


@dataclass(frozen=True)
class EngineInfo:
    """Where an engine is and what happened to it.

    incarnation: 0 for the first server process, +1 for every restart. failed: why the actor gave
    up (None while it still serves). node: the address of the node the engine runs on.
    """

    url: str
    pid: int | None
    incarnation: int
    restarts: int
    alive: bool
    failed: str | None = None
    node: str = ""


class EngineActor:
    """One SGLang server under watch. Create it through :func:`launch_engine_actor`; plain
    construction works too (the tests of the watchdog logic need no Ray)."""

    def __init__(self, settings: EngineSettings, watchdog: WatchdogSettings = DEFAULT_WATCHDOG, nodes=None):
        from megarl.log import setup_logging

        setup_logging()
        pin_gloo_interface()  # several nodes: the server's weight-sync group on the routable interface
        if settings.host is None:  # loopback on one node, else this node's address (the driver calls it there)
            settings = dataclasses.replace(settings, host=rendezvous_host())
        if settings.port is None:
            settings = dataclasses.replace(settings, port=free_port(settings.host))
        self._node = node_address()
        self._settings = settings
        self.watchdog = watchdog
        self._lock = threading.RLock()  # held for start, restart and stop
        self._engine: SGLangEngine | None = None
        self._starting: SGLangEngine | None = None  # a server being spawned (stop() cancels its start)
        self._processes: list[psutil.Process] = []  # leader + children, recorded once healthy
        self._incarnation = -1
        self._restarts = 0
        self._failed: str | None = None
        self._stopping = threading.Event()
        self._watch_thread: threading.Thread | None = None
        self._leads = settings.nnodes > 1 and settings.node_rank == 0  # node 0 of an engine over several nodes
        if self._leads and nodes is None:
            raise ValueError(f"an engine on nnodes={settings.nnodes} needs its nodes (engine_nodes, or seats)")
        # an engine over several nodes: its placement group (bundle r holds node r), or its seats (one per node)
        self._nodes = nodes
        self._followers: list = []  # the follower actors of nodes 1.. while the engine runs

    @property
    def url(self) -> str:
        return f"http://{self._settings.host}:{self._settings.port}"

    def start(self) -> EngineInfo:
        """Start the server, wait until healthy, start the watchdog. Raises EngineStartError."""
        with self._lock:
            if self._engine is not None:
                raise RuntimeError(f"engine at {self.url} already started")
            self._spawn(self._settings)
            self._watch_thread = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
            self._watch_thread.start()
        return self.info()

    def _spawn(self, settings: EngineSettings) -> None:
        if self._leads:  # node 0's rendezvous for the other nodes' ranks, fresh at every start
            settings = dataclasses.replace(settings, dist_init_addr=f"{settings.host}:{free_port(settings.host)}")
        engine = SGLangEngine(settings)
        self._starting = engine
        try:
            if self._stopping.is_set():  # stop() came before this start: it gives up at once
                engine.cancel_start()
            followers = self._start_followers(settings) if self._leads else []
            engine.start()
            self._await_followers(followers)
        except BaseException:
            engine.stop()
            self._stop_followers()
            raise
        finally:
            self._starting = None
        leader = psutil.Process(engine.pid)
        self._engine, self._processes = engine, [leader, *leader.children(recursive=True)]
        self._incarnation += 1

    def _start_followers(self, settings: EngineSettings) -> list:
        """The start calls of the follower actors of nodes 1.. (none on one node), one per node of the
        engine (:func:`follower_options`), each serving ``settings`` as its node's rank on a port of its own."""
        import ray

        self._followers = []
        for rank in range(1, settings.nnodes):
            options, visible_gpus = follower_options(self._nodes, rank)
            log_path = f"{settings.log_path}.node{rank}" if settings.log_path else None
            follower = dataclasses.replace(settings, node_rank=rank, host=None, port=None, log_path=log_path,
                                           visible_gpus=visible_gpus)
            remote = ray.remote(num_cpus=0, max_concurrency=4, **options)(EngineActor)
            self._followers.append(remote.remote(follower, dataclasses.replace(self.watchdog, max_restarts=0)))
        return [f.start.remote() for f in self._followers]

    def _await_followers(self, starts: list) -> None:
        """Wait for the followers' starts (their node's server healthy); EngineStartError naming the node
        that failed."""
        import ray

        for rank, start in enumerate(starts, 1):
            try:
                ray.get(start)
            except Exception as e:
                raise EngineStartError(f"node {rank} of the engine at {self.url} did not start: {e}") from e

    def _stop_followers(self) -> None:
        if not self._followers:
            return
        import ray

        followers, self._followers = self._followers, []
        try:
            ray.get([f.stop.remote() for f in followers], timeout=60)
        except Exception as e:  # a follower already gone: its server went with its process group
            log.warning("stopping the other nodes of the engine at %s: %s", self.url, e)
        finally:
            for follower in followers:
                ray.kill(follower)

    def _followers_alive(self) -> bool:
        if not self._followers:
            return True
        import ray

        try:
            return all(info.alive for info in ray.get([f.info.remote() for f in self._followers], timeout=30))
        except Exception:
            return False

    def _alive(self) -> bool:
        return self._engine is not None and all(_running(p) for p in self._processes) and self._followers_alive()

    def _watch(self) -> None:
        while not self._stopping.wait(self.watchdog.poll_interval_s):
            if self._failed is None and not self._alive():
                with self._lock:
                    try:
                        self._restart_while_dead()
                    except EngineDiedError:
                        pass  # recorded in self._failed and logged; ensure_healthy callers get the error

    def _restart_while_dead(self) -> None:
        """Under the lock: restart until alive; raises EngineDiedError when stopped or given up."""
        if self._stopping.is_set():
            raise EngineDiedError(f"engine at {self.url} is stopped")
        while self._failed is None and not self._alive():
            self._restart("died")
            if self._stopping.is_set():  # the restart was cancelled by stop()
                raise EngineDiedError(f"engine at {self.url} is stopped")
        if self._failed is not None:
            raise EngineDiedError(self._failed)

    def _answers(self) -> bool:
        try:
            response = httpx.get(self.url + "/model_info", timeout=10.0, headers=auth_headers(self._settings.api_key))
            return response.status_code == 200
        except httpx.TransportError:
            return False

    def ensure_healthy(self) -> EngineInfo:
        """Return the engine's info once it runs and answers HTTP: at once when it does, else after
        restarting it (a dead process, or one silent for ``unresponsive_restart_s``) or waiting for
        the restart under way. Raises EngineDiedError when the actor gave up or was stopped."""
        silent_s = self.watchdog.unresponsive_restart_s
        deadline = time.monotonic() + silent_s
        while True:
            with self._lock:
                self._restart_while_dead()
                if self._answers():
                    return self.info()
                if time.monotonic() > deadline:
                    self._restart(f"does not answer {self.url}/model_info for {silent_s:g} s")
                    deadline = time.monotonic() + silent_s
            time.sleep(self.watchdog.poll_interval_s)

    def _restart(self, why: str) -> None:
        old_pid = self._engine.pid if self._engine is not None else None
        tail = self._engine.log_tail(15) if self._engine is not None else ""
        if self._restarts >= self.watchdog.max_restarts:
            self._failed = (f"SGLang server at {self.url} {why} and was already restarted {self._restarts} times "
                            f"(max_restarts); last log:\n{tail}")
            log.error("%s", self._failed)
            return
        self._restarts += 1
        log.warning("SGLang server pid %s at %s %s; restart %d/%d. Log tail:\n%s", old_pid, self.url, why,
                    self._restarts, self.watchdog.max_restarts, tail)
        if self._engine is not None:
            self._engine.stop()  # reaps the leader and kills the rest of its process group
        self._stop_followers()  # every node starts again
        self._engine, self._processes = None, []
        try:
            self._spawn(self._settings)
        except EngineStartError as e:
            log.error("restart %d of the SGLang server at %s failed: %s", self._restarts, self.url, e)
            return
        log.warning("SGLang server at %s restarted as pid %d (incarnation %d)", self.url, self._engine.pid,
                    self._incarnation)

    def info(self) -> EngineInfo:
        engine = self._engine
        return EngineInfo(url=self.url, pid=engine.pid if engine is not None else None,
                          incarnation=self._incarnation, restarts=self._restarts, alive=self._alive(),
                          failed=self._failed, node=self._node)

    def log_tail(self, num_lines: int = 40) -> str:
        engine = self._engine
        return engine.log_tail(num_lines) if engine is not None else ""

    def stop(self) -> None:
        """Stop the watchdog, then the server (its whole process group); a start or restart under
        way gives up first (its ``start`` raises EngineStartError), rather than loading to the end.
        Idempotent."""
        self._stopping.set()
        starting = self._starting
        if starting is not None:
            starting.cancel_start()
        if self._watch_thread is not None:
            self._watch_thread.join()
        with self._lock:
            if self._engine is not None:
                self._engine.stop()
            self._stop_followers()
            self._engine, self._processes = None, []


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def engine_nodes(settings: EngineSettings, *, num_cpus: float = 0.5, num_gpus: float = 0):
    """The placement group of an engine over ``settings.nnodes`` > 1 nodes (None on one node): one
    bundle a node, on distinct nodes (STRICT_SPREAD), each with ``num_cpus``, ``num_gpus / nnodes``
    GPUs and the engine role's unit (:func:`megarl.parallel.role_resources`). Its owner removes it
    after the engine's actors (``ray.util.remove_placement_group``)."""
    if settings.nnodes == 1:
        return None
    from ray.util.placement_group import placement_group

    bundle = {"CPU": num_cpus, **role_resources("engine"), **({"GPU": num_gpus / settings.nnodes} if num_gpus else {})}
    return placement_group([bundle] * settings.nnodes, strategy="STRICT_SPREAD")


def follower_options(nodes, rank: int) -> tuple[dict, tuple[str, ...]]:
    """The Ray options of the follower actor of node ``rank`` of an engine over several nodes, and the GPUs
    its server runs on (() : those Ray gives the actor): in bundle ``rank`` of the engine's placement group
    (:func:`engine_nodes`) with that bundle's GPUs and role unit, or on the node of seat ``rank`` of a pinned
    engine (``nodes`` a list of :class:`~megarl.parallel.places.Place`, :mod:`megarl.engines.pinning`),
    asking nothing of Ray there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    if isinstance(nodes, (list, tuple)):
        seat = nodes[rank]
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=seat.node_id, soft=False)}, seat.gpus
    bundle = dict(nodes.bundle_specs[rank])  # the node's GPUs (CUDA_VISIBLE_DEVICES) and role unit
    gpus, _ = bundle.pop("GPU", 0), bundle.pop("CPU", None)
    return {"num_gpus": gpus, "resources": bundle or None, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=nodes, placement_group_bundle_index=rank)}, ()


def launch_engine_actor(settings: EngineSettings, *, num_cpus: float = 0.5, num_gpus: float = 0,
                        watchdog: WatchdogSettings = DEFAULT_WATCHDOG, nodes=None, seats=None, **ray_options):
    """Create an :class:`EngineActor` as a Ray actor (not started yet: call ``start.remote()``).

    ``num_cpus`` is the actor's Ray reservation; the server process is not accounted by Ray, so on
    CPU keep it small. On GPUs pass ``num_gpus`` = the engine's TP size: Ray then sets
    ``CUDA_VISIBLE_DEVICES`` for the actor, which the server inherits. When some node of the
    cluster offers the custom resource ``megarl_engine``, the actor asks for one unit of it
    (:func:`megarl.parallel.role_resources`): engines then run on the nodes set aside for them.
    An engine over ``settings.nnodes`` > 1 nodes runs in bundle 0 of ``nodes``, its placement group
    (:func:`engine_nodes`), with that bundle's share of ``num_gpus``, and starts the other nodes'
    servers in the other bundles (see the module docstring).

    ``seats`` (one :class:`~megarl.parallel.places.Place` per node of the engine,
    :func:`megarl.engines.pinning.colocated_seats`) pins a colocated engine instead: each node's server
    on its seat's node (hard node affinity) and its seat's GPUs, with no GPU and no role unit asked
    of Ray (the trainer ranks beside it hold them); ``nodes`` and ``num_gpus`` are then unused.
    """
    import ray

    resources = {**role_resources("engine"), **ray_options.pop("resources", {})}
    if seats is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if len(seats) != settings.nnodes:
            raise ValueError(f"an engine on nnodes={settings.nnodes} needs one seat a node, got {len(seats)}")
        settings = dataclasses.replace(settings, visible_gpus=seats[0].gpus)
        ray_options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=seats[0].node_id, soft=False)
        nodes, num_gpus = (list(seats) if settings.nnodes > 1 else None), 0
    elif settings.nnodes > 1:
        if nodes is None:
            raise ValueError(f"an engine on nnodes={settings.nnodes} needs its placement group (engine_nodes)")
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray_options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=nodes,
                                                                              placement_group_bundle_index=0)
        num_gpus = num_gpus / settings.nnodes
    elif resources:
        ray_options["resources"] = resources
    remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=4, **ray_options)(EngineActor)
    return remote.remote(settings, watchdog, nodes=nodes)
