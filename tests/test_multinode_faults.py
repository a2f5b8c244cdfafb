"""Faults at cluster scale: a trainer node that leaves the Ray cluster is found dead from Ray's node
table, and a trainer rank whose process dies alone from Ray's answer to a call to it
(megarl/pipeline/node_watch.py); either ends the run with one line naming it and status 75, which
slurm/megarl.sbatch requeues; the requeued run, the conversion tool and the rerun message take the
newest *complete* checkpoint, never the ``latest`` pointer alone."""
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from omegaconf import OmegaConf
from test_multinode import PYTHON, ROOT

from megarl.metrics.sink import read_metrics
from megarl.pipeline.node_watch import (
    TrainerNodeLost,
    TrainerRankLost,
    cancel_on_loss,
    dead_nodes,
    loss_of,
    node_ids,
    rank_died_in,
    watch_trainer,
)
from megarl.pipeline.run import Pipeline
from megarl.rehearsal import fake_nodes as netns
from megarl.rehearsal.ray_nodes import RayOnNodes, node_env
from megarl.sync import WeightSyncError
from megarl.trainer.checkpoint import _file_record, _write_completion_record, step_dir
from megarl.trainer.convert import ConversionError, checkpoint_dir


def ray_node(node_id: str, address: str, alive: bool = True) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive}


@pytest.mark.unit
def test_a_trainer_node_is_dead_once_ray_reports_it_dead_or_a_new_node_takes_its_address():
    nodes = [ray_node("a", "10.0.0.2"), ray_node("b", "10.0.0.3"), ray_node("old", "10.0.0.3", alive=False)]
    watched = node_ids(["10.0.0.2", "10.0.0.3"], nodes)
    assert watched == {"10.0.0.2": "a", "10.0.0.3": "b"}
    assert dead_nodes(watched, nodes) == []
    rejoined = [ray_node("a", "10.0.0.2"), ray_node("b", "10.0.0.3", alive=False), ray_node("c", "10.0.0.3")]
    assert dead_nodes(watched, rejoined) == ["10.0.0.3"]  # the node came back as a new Ray node: its ranks are gone
    assert dead_nodes(watched, nodes[:1]) == ["10.0.0.3"]  # no longer listed
    with pytest.raises(ValueError, match=r"no alive Ray node at \['10.0.0.9'\]"):
        node_ids(["10.0.0.9"], nodes)


@pytest.mark.unit
def test_a_lost_node_cancels_the_run_which_then_raises_the_loss():
    async def body():
        async def lose():
            await asyncio.sleep(0.05)
            raise TrainerNodeLost("trainer node 10.0.0.3 left the Ray cluster")

        run = asyncio.create_task(asyncio.sleep(30))
        watch = asyncio.create_task(lose())
        cancel_on_loss(watch, run)
        with pytest.raises(asyncio.CancelledError):
            await run
        return loss_of(watch)

    lost = asyncio.run(body())
    assert isinstance(lost, TrainerNodeLost) and "10.0.0.3" in str(lost)
    assert loss_of(None) is None


@pytest.mark.unit
def test_a_call_to_a_rank_that_died_in_start_up_is_its_loss():
    from ray.exceptions import ActorDiedError

    died = ActorDiedError()
    died.error_msg = ("The actor died unexpectedly before finishing this task.\n\tclass_name: TrainerRank\n"
                      "\tactor_id: 9e4f\n\tpid: 4845\n\tip: 10.213.0.5\nThe actor is dead because ...")
    try:
        try:
            raise died
        except ActorDiedError as e:
            raise WeightSyncError("weight sync to version 1 failed", 1, [], []) from e
    except WeightSyncError as wrapped:
        lost = rank_died_in(wrapped)
    assert isinstance(lost, TrainerRankLost) and "died during start-up (ip: 10.213.0.5; ActorDiedError" in str(lost)
    other = ActorDiedError()
    other.error_msg = "The actor died.\n\tclass_name: EngineActor"
    assert rank_died_in(other) is None and rank_died_in(ValueError("x")) is None


@pytest.mark.unit
def test_the_watch_names_a_dead_rank_on_a_live_node_and_a_dead_node_as_such(monkeypatch):
    """Ray's node table and the ranks' answers, stood in for: a rank whose process is gone on a node still
    alive ends the watch with TrainerRankLost naming the rank and its node; one whose node Ray reports dead
    by the time the watch looks again, with TrainerNodeLost."""
    import ray

    nodes = [ray_node("a", "10.0.0.2"), ray_node("b", "10.0.0.3")]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    answers = iter([{}, {}, {1: "ActorDiedError: The actor died unexpectedly"}])

    async def dead_ranks(timeout_s):
        return next(answers)

    with pytest.raises(TrainerRankLost, match=r"\(rank 1 on 10.0.0.3: ActorDiedError: The actor died unexpectedly\)"):
        asyncio.run(watch_trainer(["10.0.0.2", "10.0.0.3"], dead_ranks, 0.01))

    async def node_went_with_its_rank(timeout_s):
        nodes[1] = ray_node("b", "10.0.0.3", alive=False)  # Ray reports the node after its rank
        return {1: "ActorDiedError: The actor died because its node has died"}

    with pytest.raises(TrainerNodeLost, match="trainer node 10.0.0.3 left the Ray cluster"):
        asyncio.run(watch_trainer(["10.0.0.2", "10.0.0.3"], node_went_with_its_rank, 0.01))


class FailingSync:
    """A weight sync whose first ``failures`` updates fail as ``errors`` say; records what it did."""

    def __init__(self, engines: list[str], errors: list):
        self.engines, self.errors, self.calls = list(engines), list(errors), []

    async def update(self, version, mode):
        self.calls.append(("update", version, list(self.engines)))
        if self.errors:
            failed, held = self.errors.pop(0)
            self.engines = [e for e in self.engines if e not in failed + held]
            raise WeightSyncError("stand-in", version, failed, held)
        return SimpleNamespace(metrics=lambda: {"sync/version": float(version)})

    async def recover(self, client):
        self.calls.append(("recover", client.base_url))
        self.engines.append(client.base_url)


@pytest.mark.unit
def test_a_sync_that_lost_an_engine_is_done_again_for_the_others_once():
    """An engine died mid-sync: the held one is recovered, then the sync runs again for the engines that
    resumed on their previous weights (sync mode needs the next batch from the new version); a failure
    with no engine lost (a timeout) is reported, not repeated."""
    clients = [SimpleNamespace(base_url=u) for u in ("a", "b", "c")]

    def pipeline(sync):
        pipe = SimpleNamespace(sync=sync, pool=SimpleNamespace(clients=clients), pause_mode=None, membership=None)
        pipe._sync_update = lambda version: Pipeline._sync_update(pipe, version)
        return pipe

    died = FailingSync(["a", "b", "c"], [(["a"], ["b"])])
    assert asyncio.run(Pipeline._sync(pipeline(died), 4)) == {"sync/version": 4.0, "sync/retried": 1.0}
    assert died.calls == [("update", 4, ["a", "b", "c"]), ("recover", "b"), ("update", 4, ["c", "b"])]
    timed_out = FailingSync(["a"], [([], [])])
    assert asyncio.run(Pipeline._sync(pipeline(timed_out), 4)) == {"sync/failed": 1.0}
    assert timed_out.calls == [("update", 4, ["a"])]
    twice = FailingSync(["a", "b"], [(["a"], []), (["b"], [])])
    assert asyncio.run(Pipeline._sync(pipeline(twice), 4)) == {"sync/failed": 1.0} and len(twice.calls) == 2


class HangingSync:
    """A sync stuck on an unreachable engine until cancelled, which ends it as WeightSync does: an error
    naming the engine that failed."""

    engines = ["a", "b"]

    async def update(self, version, mode):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise WeightSyncError("cut short", version, ["b"], []) from None


@pytest.mark.unit
def test_a_sync_is_cut_short_when_one_of_its_engines_is_lost():
    pipe = SimpleNamespace(sync=HangingSync(), pause_mode=None,
                           membership=SimpleNamespace(sync_engine_lost=lambda: asyncio.sleep(0.1)))

    async def body():
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(WeightSyncError, match="cut short") as error:
            await Pipeline._sync_update(pipe, 4)
        return asyncio.get_running_loop().time() - t0, error.value.failed

    took, failed = asyncio.run(body())
    assert took < 2 and failed == ["b"]


def save(root: Path, step: int, complete: bool) -> None:
    """A stand-in checkpoint of ``step`` under ``root`` (``latest`` names it), with its completion
    record when ``complete``."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps({"step": step}))
    (path / "shard.distcp").write_bytes(bytes(range(256)) * step)
    if complete:
        _write_completion_record(path, step, {n: _file_record(path / n) for n in ("metadata.json", "shard.distcp")})
    (root / "latest").write_text(str(step))


@pytest.mark.unit
def test_conversion_and_the_rerun_message_take_the_newest_complete_checkpoint(tmp_path):
    from megarl.train import what_a_rerun_does

    root = tmp_path / "run" / "checkpoints"
    save(root, 1, complete=True)
    save(root, 2, complete=True)
    (step_dir(root, 2) / "shard.distcp").write_bytes(b"torn")  # truncated by a node lost mid-save
    save(root, 3, complete=False)  # its save never finished; latest names it
    assert checkpoint_dir(root) == step_dir(root, 1)
    assert checkpoint_dir(step_dir(root, 3)) == step_dir(root, 3)  # a directory named on purpose is taken as is
    cfg = OmegaConf.create({"mode": "sync", "logging": {"run_dir": str(tmp_path / "run")}, "trainer": {"resume": True}})
    message = what_a_rerun_does(cfg)
    assert message.startswith("the same command resumes after step 1 (the run's newest complete checkpoint")
    assert "iter_0000003 (no complete.json" in message and "iter_0000002 (shard.distcp" in message
    (step_dir(root, 1) / "complete.json").unlink()
    with pytest.raises(ConversionError, match="holds no complete checkpoint"):
        checkpoint_dir(root)
    assert "holds no complete checkpoint" in what_a_rerun_does(cfg)


# --- on fake nodes: a Ray cluster, a driver, and nodes that fail -----------------------------------------

FAKE_NODE_COUNT = 4  # the fake_nodes fixture (tests/conftest.py)
# node 0: the head, the driver and a trainer rank; nodes 1 and 2: an engine each; node 3: a trainer rank
ROLES = {0: {"megarl_trainer": 1}, 1: {"megarl_engine": 1}, 2: {"megarl_engine": 1}, 3: {"megarl_trainer": 1}}
# Ray's health check of the nodes (by the head's GCS) every second rather than every 3 s: a killed node
# refuses the checks at once and is marked dead after 5 failed ones. A node cut off fails a check only
# when it times out (10 s, unchanged); the engine-node test takes either outcome of its cut.
RAY_HEALTH_CHECK = {"RAY_health_check_period_ms": "1000"}


@pytest.fixture(scope="module")
def cluster(fake_nodes, tmp_path_factory):
    """The module's Ray cluster over the fake nodes (``ROLES``); nodes killed by a test are back after it."""
    ray_nodes = RayOnNodes(fake_nodes, tmp_path_factory.mktemp("ray_nodes"), resources=ROLES, env=RAY_HEALTH_CHECK)
    try:
        for node in fake_nodes:
            ray_nodes.start(node.index)
        yield ray_nodes
    finally:
        ray_nodes.stop()


class Driver:
    """``python -m megarl.train`` in node 0 against the cluster, with the tiny checkpoint and no warm-up."""

    def __init__(self, cluster: RayOnNodes, run: Path, tiny_checkpoint: str, *overrides: str):
        self.run, self.log = run, run.parent / f"{run.name}-driver.log"
        self.offset = self.log.stat().st_size if self.log.exists() else 0  # a requeue's driver appends to the log
        self.started = time.time()
        args = ["recipe=tiny_moe_cpu", "mode=sync", "placement=disaggregated", "warmup.steps=0",
                f"model.hf_path={tiny_checkpoint}", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                "sync.transport=distributed", "sync.timeout_s=120", f"logging.run_dir={run}", *overrides]
        with open(self.log, "a") as out:
            self.process = cluster.nodes[0].popen([PYTHON, "-m", "megarl.train", *args], cwd=ROOT, stdout=out,
                                                  stderr=subprocess.STDOUT,
                                                  env=node_env(RAY_ADDRESS=cluster.address))

    def rows(self) -> list[dict]:
        if not (self.run / "metrics.jsonl").is_file():
            return []
        return [r for r in read_metrics(self.run) if "reward/mean" in r]

    def until(self, found, timeout: float, what: str):
        """Poll ``found()`` every 0.5 s while the driver runs; its first true value, else fail naming ``what``."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            value = found()
            if value:
                return value
            time.sleep(0.5)
        self.kill()
        pytest.fail(f"{what}: not within {timeout:g} s (driver exit {self.process.poll()}):\n{self.output()[-6000:]}")

    def engines_after(self, count: int, since: float) -> dict | None:
        """The first step row logged after unix time ``since`` with ``count`` engines taking prompts."""
        return next((r for r in self.rows() if r["time"] > since and r["rollout/engines"] == count), None)

    def output(self) -> str:
        """What this driver wrote to the log (an earlier driver's lines of the same run left out)."""
        with open(self.log, "rb") as log:
            log.seek(self.offset)
            return log.read().decode(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def trained_prompts(run: Path) -> list[int]:
    """Every prompt index trained in the run's lineage, in order (duplicates kept)."""
    lines = (run / "trained_prompts.jsonl").read_text().splitlines()
    return [i for line in lines for i in json.loads(line)["prompts"]]


def assert_ledger_adds_up(row: dict) -> None:
    """The step row's sample counts: started == ended + in flight + buffered."""
    ended = sum(v for k, v in row.items() if k.startswith("buffer/") and not k.startswith("buffer/prompts_")
                and k not in ("buffer/samples_started", "buffer/samples_buffered", "buffer/samples_in_flight"))
    assert row["buffer/samples_started"] == ended + row["buffer/samples_in_flight"] + row["buffer/samples_buffered"]


def kill_rank_during(node, call: str, driver: Driver, timeout: float = 600) -> float:
    """SIGKILL the trainer rank's process on ``node`` once it runs ``call`` (Ray titles a rank's process
    ``ray::TrainerRank.<call>`` while the call runs) after the driver's first step of its own (a weight sync
    of the run, not the start-up's); the monotonic time of the kill. The title is read from /proc every
    millisecond: a sync's calls on a rank that does not send last about that long each."""
    deadline, rank, stepped = time.monotonic() + timeout, None, False
    while driver.process.poll() is None and time.monotonic() < deadline:
        if rank is None or not stepped:
            rank = next((p for p in map(_process, node.pids()) if _title(p).startswith("ray::TrainerRank")), None)
            stepped = any(r["time"] > driver.started for r in driver.rows())
            time.sleep(0.2)
            continue
        if _proc_title(rank.pid).startswith(f"ray::TrainerRank.{call}"):
            os.kill(rank.pid, signal.SIGKILL)
            return time.monotonic()
        time.sleep(0.001)
    driver.kill()
    pytest.fail(f"no trainer rank ran {call} on node {node.index} within {timeout:g} s:\n{driver.output()[-6000:]}")


def _process(pid: int) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid)
    return None


def _title(process: psutil.Process | None) -> str:
    """The process's title (its command line), "" for one that is gone."""
    with contextlib.suppress(psutil.Error, AttributeError):
        return " ".join(process.cmdline())
    return ""


def _proc_title(pid: int) -> str:
    """The title of process ``pid`` read straight from /proc (no psutil round), "" once it is gone."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    return ""


def ended_for_a_requeue(driver: Driver, lost_at: float, names: str) -> int:
    """The driver ended within the bound after its loss at ``lost_at`` (monotonic), status 75 and one last
    line matching ``names``; the step the same command resumes after (a complete checkpoint's)."""
    driver.process.wait(240)
    ended_s = time.monotonic() - lost_at
    output = driver.output()
    assert driver.process.returncode == 75, output[-8000:]
    assert ended_s < 1 + 60 + 60, ended_s  # the check period, Ray's detection of the loss, the teardown
    last = [line for line in output.splitlines() if line.startswith("megarl: ")]
    assert len(last) == 1 and re.search(names, last[0]), output[-4000:]
    kept = int(re.search(r"resumes after step (\d+)", last[0]).group(1))
    assert checkpoint_dir(driver.run / "checkpoints") == step_dir(driver.run / "checkpoints", kept)
    return kept


STEPS = 6  # room for a step of each requeued run before its kill, and for the last requeue's


@pytest.mark.network
def test_a_lost_trainer_node_or_rank_ends_the_run_and_the_requeues_resume_exactly(cluster, tiny_checkpoint,
                                                                                   tmp_path):
    """Trainer ranks on nodes 0 and 3 (DP2), a checkpoint every step. Node 3 is killed mid-run: the
    driver ends within the bound, exit status 75 (what slurm/megarl.sbatch requeues on) and one line
    naming node 3; the newest complete checkpoint is intact. Node 3 back, the same command (the
    requeue) resumes from that checkpoint; node 3's rank process alone is killed during a training step:
    the same status and a line naming the rank and node 3; requeued again, the rank is killed during a
    weight sync: the same (each after a step of the requeued run). The last requeue finishes: step
    numbers continue, no prompt trained twice."""
    n3 = cluster.nodes[3]
    run = tmp_path / "run"
    overrides = ("parallel.world_size=2", "trainer.save_interval=1", "cluster.node_check_s=1", f"steps={STEPS}")
    started, ended = time.monotonic(), []
    first = Driver(cluster, run, tiny_checkpoint, *overrides)
    try:
        first.until(lambda: len(first.rows()) >= 2, 600, "two steps")
        killed = time.monotonic()
        netns.kill_namespace_processes(n3.namespace, hard=True)
        kept = ended_for_a_requeue(first, killed, rf"trainer node {re.escape(n3.address)} left the Ray cluster")
        ended.append(time.monotonic() - killed)
    finally:
        first.kill()
        cluster.start(3)
    assert kept >= 1
    rank_lost = rf"trainer rank process died while its node stayed in the Ray cluster \(rank \d on {n3.address}:"
    # the requeued job (the same command), its rank killed in the call; a sync of one engine call a tensor
    # gives the rank's sync calls a few seconds a step to be caught in
    for call, more in (("rl_step", ()), ("weight_sync", ("sync.bucket_mb=0",))):
        again = Driver(cluster, run, tiny_checkpoint, *overrides, *more)
        try:
            killed = kill_rank_during(n3, call, again)
            resumed = ended_for_a_requeue(again, killed, rank_lost)
            ended.append(time.monotonic() - killed)
        finally:
            again.kill()
        assert f"resuming at step {kept}" in again.output() and resumed >= kept
        kept = resumed
    last = Driver(cluster, run, tiny_checkpoint, *overrides)
    try:
        last.process.wait(900)
    finally:
        last.kill()
    print(f"\n[measured] trainer node killed, then a rank in a step, then in a sync: the driver ended "
          f"{', '.join(f'{s:.0f}' for s in ended)} s after; the last requeue finished: "
          f"{time.monotonic() - started:.0f} s in all")
    assert last.process.returncode == 0, last.output()[-8000:]
    assert f"resuming at step {kept}" in last.output()
    assert [r["step"] for r in last.rows()] == list(range(1, STEPS + 1))
    prompts = trained_prompts(run)
    assert len(prompts) == len(set(prompts)) == STEPS * 2  # every prompt trained once over all the runs


TRANSFER_MBIT = 4  # an engine node's link while a test waits for a sync's bucket: ~4 s for the tiny model's
BULK_BYTES = 150_000  # into the node within BULK_WINDOW_S: a bucket in transfer (the rest is a few kB/s)
BULK_WINDOW_S = 0.5


def cut_during_a_transfer(nodes, index: int, driver: Driver, timeout: float = 180) -> float:
    """Shape node ``index``'s link to ``TRANSFER_MBIT``, wait until a weight-sync bucket flows into it
    and cut the link then, leaving the transfer stuck; the unix time of the cut."""
    nodes.limit_rate(index, TRANSFER_MBIT)
    try:
        samples = [(time.monotonic(), nodes.bytes_into(index))]
        deadline = time.monotonic() + timeout
        while driver.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            samples.append((time.monotonic(), nodes.bytes_into(index)))
            samples = [s for s in samples if s[0] >= samples[-1][0] - BULK_WINDOW_S]
            if samples[-1][1] - samples[0][1] >= BULK_BYTES:
                nodes.set_link(index, up=False)
                return time.time()
        driver.kill()
        pytest.fail(f"no weight-sync bucket into node {index} within {timeout:g} s:\n{driver.output()[-6000:]}")
    finally:
        nodes.limit_rate(index, None)


LOST_S = 10  # rollout.engine_lost_s of the engine-node run
CUT_S = 20  # how long its engine node is cut off (seconds): twice the lost-engine bound


def cut_off(cluster: RayOnNodes, driver: Driver, index: int) -> dict:
    """Node ``index``'s link down for ``CUT_S`` (and until its engine is lost), cut while a weight sync's
    bucket flows into it; back once an engine serves there again. The times of the cut, the link's return
    and the engine's, and the rows."""
    down_at = cut_during_a_transfer(cluster.nodes, index, driver)
    try:
        lost = driver.until(lambda: driver.engines_after(1, down_at), 60, "the unreachable engine lost")
        time.sleep(max(0.0, down_at + CUT_S - time.time()))
    finally:
        cluster.nodes.set_link(index, up=True)
    up_at = time.time()

    def back():
        if cluster.processes[index].poll() is not None:  # Ray marked the node dead and its raylet left
            cluster.start(index)
        return driver.engines_after(2, up_at)

    returned = driver.until(back, 400, f"node {index}'s engine back")
    driver.until(lambda: [r for r in driver.rows() if r["step"] > returned["step"] + 1], 120, "more steps")
    return {"down_at": down_at, "lost": lost, "up_at": up_at, "returned": returned}


def killed_and_back(cluster: RayOnNodes, driver: Driver, index: int) -> dict:
    """Every process of node ``index`` killed, the node started again; once an engine joined there and a
    sync went into both engines. The kill's time, the first rows with one engine and with two again."""
    killed_at = time.time()
    netns.kill_namespace_processes(cluster.nodes[index].namespace, hard=True)
    lost = driver.until(lambda: driver.engines_after(1, killed_at), 180, "the killed node's engine lost")
    cluster.start(index)  # the node comes back
    back_at = time.time()
    joined = driver.until(lambda: driver.engines_after(2, back_at), 400, "an engine on the returned node")
    driver.until(lambda: [r for r in driver.rows() if r["step"] > joined["step"] and r["sync/engines"] == 2],
                 120, "a sync into both engines")
    return {"killed_at": killed_at, "lost": lost, "joined": joined}


@pytest.mark.network
def test_engine_nodes_cut_off_killed_return_join_and_leave_a_running_job(cluster, tiny_checkpoint, tmp_path):
    """Engines on nodes 1 and 2, one run through the engine-node faults. (1) Node 2's link goes down for
    ``CUT_S`` (its processes run on, unreachable), cut while a weight sync's bucket flows into it: the
    trainer's transfer is stuck on the lost peer, yet the sync ends at the engine-lost bound, not at
    ``sync.timeout_s`` (the trainer takes the abort at once; the next sync links node 1's engine anew);
    its prompts go to node 1's engine. With the link back the engine returns with the current weights:
    it rejoins through a full sync if Ray kept its node, else Ray's node returns (the raylet, marked
    dead, exits; it is started again as a node's service manager would) and a new engine joins there.
    (2) Node 2 is killed (every process: raylet, engine actor, server): lost within the bound, the run
    goes on; node 2 joins the Ray cluster again: an engine starts there, gets a full sync and takes
    prompts. (3) Node 1's engine is asked to leave: it drains and stops. A stop request ends the run:
    every later batch came from the current weights, every prompt was trained once, the ledger adds up
    at every step."""
    n1, n2 = cluster.nodes[1], cluster.nodes[2]
    run = tmp_path / "run"
    started = time.monotonic()
    driver = Driver(cluster, run, tiny_checkpoint, "steps=100000", "rollout.num_engines=2", "rollout.max_engines=2",
                    f"rollout.engine_lost_s={LOST_S}", "rollout.engine_health_check_s=1", "rollout.engine_drain_s=20")
    try:
        driver.until(lambda: driver.engines_after(2, 0), 600, "a step with both engines")
        cut = cut_off(cluster, driver, 2)
        kill = killed_and_back(cluster, driver, 2)
        (run / "leave_engines").write_text(f"{n1.address}\n")
        asked_at = time.time()
        left = driver.until(lambda: driver.engines_after(1, asked_at), 180, "node 1's engine gone")
        after = driver.until(lambda: [r for r in driver.rows() if r["step"] > left["step"]], 180, "a step after")
        driver.process.send_signal(signal.SIGTERM)
        driver.process.wait(180)
    finally:
        driver.kill()
        cluster.nodes.set_link(2, up=True)
        if cluster.processes[2].poll() is not None:
            cluster.start(2)
    output = driver.output()
    how = "rejoined" if re.search(r"engine \d at \S+ rejoined", output) else "joined anew"
    cut_lost_s, kill_lost_s = cut["lost"]["time"] - cut["down_at"], kill["lost"]["time"] - kill["killed_at"]
    print(f"\n[measured] engine node cut off {CUT_S} s (lost after {cut_lost_s:.0f} s, back ({how}) "
          f"{cut['returned']['time'] - cut['up_at']:.0f} s after the link), killed (lost after {kill_lost_s:.0f} s), "
          f"back, joined, left: {time.monotonic() - started:.0f} s")
    assert driver.process.returncode == 0, output[-8000:]
    rows = driver.rows()
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    prompts = trained_prompts(run)
    assert len(prompts) == len(set(prompts)) == 2 * len(rows) and len(after) >= 1  # every prompt trained once
    for row in rows:
        assert_ledger_adds_up(row)
    assert cut_lost_s < LOST_S + 30, cut["lost"]  # the bound, plus the step it shows in
    assert "weight sync to version" in output and "trainer could not abort" not in output, output[-6000:]
    assert kill_lost_s < LOST_S + 60, kill_lost_s
    assert len(re.findall(rf"engine \d at http://{re.escape(n2.address)}:\d+ lost", output)) >= 2, output[-6000:]
    assert re.search(rf"engine (\d at http://{re.escape(n2.address)}:\d+ rejoined|\d+ joined at http://"
                     rf"{re.escape(n2.address)}:)", output), output[-6000:]
    for row in [r for r in rows if cut["returned"]["step"] < r["step"] and r["time"] < kill["killed_at"]]:
        assert row["staleness/max"] == 0 and row["sync/engines"] == 2, row  # it serves the current weights
    assert len(re.findall(rf"engine \d+ joined at http://{re.escape(n2.address)}:", output)) >= 1, output[-6000:]
    assert rows[kill["joined"]["step"]]["sync/engines"] == 2  # the step after it joined synced both engines
    for row in [r for r in rows if r["step"] > kill["joined"]["step"]]:
        assert row["staleness/max"] == 0, row  # sync mode: the joined engine generated from the current weights
    assert after[0]["sync/engines"] == 1
    assert re.search(rf"engine \d at http://{re.escape(n1.address)}:\d+ stopped and left the pool", output)
