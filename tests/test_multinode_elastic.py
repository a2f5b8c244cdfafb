"""Engines that come and go in a running pool (megarl/engines/pool.py, "Membership"), with stand-in
engines: one that goes silent (its node's link down) is lost within the bound and its prompts go to
the other engine once; when it answers again it rejoins through a full sync; an engine started while
the pool runs is synced before it takes prompts; an engine asked to leave drains, then stops; the
leave file names engines by URL or node address (megarl/pipeline/membership.py)."""
import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megarl.engines.actor import EngineInfo
from megarl.engines.membership import ACTIVE, GONE, LEAVING, LOST
from megarl.engines.pool import EnginePool
from megarl.engines.supervisor import StartedEngine
from megarl.engines.types import EngineError, SamplingParams, ServedModel
from megarl.pipeline.membership import LEAVE_FILE, Membership
from megarl.sample import FinishReason, RolloutSample

pytestmark = pytest.mark.unit

MODEL = ServedModel(vocab_size=100, num_layers=2, topk=2, num_experts=8, context_length=64)
PARAMS = SamplingParams(max_new_tokens=4)


class StandIn:
    """An engine's client: answers each prompt with its first id after ``delay`` s; while ``silent``
    (its link down) no call returns."""

    def __init__(self, url: str, delay: float = 0.05):
        self.base_url, self.model, self.delay = url, MODEL, delay
        self.link = asyncio.Event()  # cleared: silent
        self.link.set()
        self.requests: list[list[str]] = []
        self.closed = False
        self.update_open = False  # a weight-update session begun and not ended

    async def _answer_or_hang(self):
        await self.link.wait()

    async def generate_batch(self, prompts, params, *, group_ids, return_routed_experts, return_sampling_mask,
                             prefix_routes=None):
        self.requests.append(list(group_ids))
        await asyncio.sleep(self.delay)
        await self._answer_or_hang()
        return [RolloutSample(prompt_ids=p, response_ids=[p[0]], loss_mask=np.ones(1, np.uint8),
                              rollout_logprobs=np.zeros(1, np.float32), model_version=np.zeros(1, np.int32),
                              routed_experts=None, sampling_mask=None, finish_reason=FinishReason.STOP, group_id=g)
                for p, g in zip(prompts, group_ids)]

    async def weight_version(self) -> int:
        await self._answer_or_hang()
        return 0

    async def end_weight_update(self):
        self.requests.append(["end_weight_update"])
        if not self.update_open:
            raise EngineError("no weight-update session is open (stand-in)")
        self.update_open = False

    async def aclose(self):
        self.closed = True


class Owner:
    """A supervisor whose engine never restarts; ``stopped`` once asked to stop."""

    def __init__(self):
        self.stopped = False

    async def ensure_healthy(self):
        return EngineInfo(url="x", pid=None, incarnation=0, restarts=0, alive=True)

    async def gone(self, timeout_s):
        return self.stopped

    async def stop(self, timeout_s):
        self.stopped = True


def answers(samples) -> list:
    return [(s.group_id, s.response_ids) for s in samples]


def test_a_silent_engine_is_lost_within_the_bound_and_rejoins_through_a_full_sync():
    clients = [StandIn("http://10.0.0.2:1"), StandIn("http://10.0.0.3:1")]
    synced = []

    async def full_sync(index, client, info):
        synced.append(index)

    pool = EnginePool(clients, [Owner(), Owner()], on_restart=full_sync, lost_after_s=0.3)

    async def body():
        watch = asyncio.create_task(pool.membership.watch(0.05))
        clients[1].link.clear()  # its link goes down before it answers
        clients[1].update_open = True  # a sync began on it, and its cleanup could not reach it
        t0 = asyncio.get_running_loop().time()
        result = await pool.generate_batch_counted([[i] for i in range(6)], PARAMS, group_ids=list("abcdef"))
        waited = asyncio.get_running_loop().time() - t0
        states, returned_while_silent = pool.membership.states, pool.membership.returned()
        clients[1].link.set()  # the link is back
        await asyncio.sleep(0.15)
        returned = pool.membership.returned()
        await pool.membership.rejoin(1)
        again = await pool.generate_batch([[i] for i in range(4)], PARAMS, group_ids=list("wxyz"))
        watch.cancel()
        return result, waited, states, returned_while_silent, returned, again

    result, waited, states, silent_returned, returned, again = asyncio.run(body())
    assert answers(result.samples) == [(g, [i]) for i, g in enumerate("abcdef")]  # every prompt once, in order
    assert result.resubmitted == 3 and pool.resubmitted == 3  # engine 1 held b, d, f: sent again once
    assert 0.3 <= waited < 1.5  # the bound plus a probe period or two, not the request's timeout
    assert states == [ACTIVE, LOST] and silent_returned == [] and returned == [1]
    assert clients[0].requests[:2] == [list("ace"), list("bdf")]  # its own, then engine 1's
    assert synced == [1] and pool.membership.states == [ACTIVE, ACTIVE] and pool.size == 2
    assert not clients[1].update_open and ["end_weight_update"] in clients[1].requests  # closed before the sync
    assert answers(again) == [(g, [i]) for i, g in enumerate("wxyz")]
    assert clients[1].requests[-1] == ["x", "z"]  # the returned engine takes prompts again


def test_the_last_engine_is_waited_for_not_lost():
    client = StandIn("http://10.0.0.2:1")
    pool = EnginePool([client], [Owner()], lost_after_s=0.1)

    async def body():
        watch = asyncio.create_task(pool.membership.watch(0.05))
        client.link.clear()
        batch = asyncio.create_task(pool.generate_batch([[1]], PARAMS, group_ids=["a"]))
        await asyncio.sleep(0.4)
        states = pool.membership.states
        client.link.set()
        out = await batch
        watch.cancel()
        return states, out

    states, out = asyncio.run(body())
    assert states == [ACTIVE] and answers(out) == [("a", [1])]


def started(url: str, model: ServedModel = MODEL) -> StartedEngine:
    client = StandIn(url)
    client.model = model
    return StartedEngine(actor=None, placement=None, client=client,
                         info=EngineInfo(url=url, pid=1, incarnation=0, restarts=0, alive=True, node=url))


def test_an_engine_joins_synced_and_one_leaves_after_its_requests():
    clients = [StandIn("http://10.0.0.2:1", delay=0.3), StandIn("http://10.0.0.3:1")]
    owners = [Owner(), Owner()]
    events = []

    async def full_sync(index, client, info):
        events.append(("sync", index, pool.membership.states[index]))

    pool = EnginePool(clients, owners, on_restart=full_sync)
    newcomer = started("http://10.0.0.4:1")

    async def body():
        index = await pool.membership.admit(newcomer)
        busy = asyncio.create_task(pool.generate_batch([[1], [2], [3]], PARAMS, group_ids=["a", "b", "c"]))
        await asyncio.sleep(0.05)  # engine 0 holds "a" (0.3 s)
        leaving = asyncio.create_task(pool.membership.remove(0, drain_s=5.0))
        await asyncio.sleep(0.05)
        during = pool.membership.states[0]
        later = await pool.generate_batch([[i] for i in range(4)], PARAMS, group_ids=list("wxyz"))
        await leaving
        return index, during, await busy, later

    index, during, first, later = asyncio.run(body())
    assert index == 2 and events == [("sync", 2, LEAVING)]  # synced before it took a prompt
    assert answers(first) == [("a", [1]), ("b", [2]), ("c", [3])]
    assert clients[0].requests == [["a"]]  # it finished "a", and got nothing while leaving
    assert during == LEAVING and pool.membership.states == [GONE, ACTIVE, ACTIVE] and owners[0].stopped
    assert clients[0].closed and [c.base_url for c in pool.clients] == ["http://10.0.0.3:1", "http://10.0.0.4:1"]
    assert newcomer.client.requests == [["c"], ["x", "z"]]  # placed least-loaded with engine 1
    assert pool.resubmitted == 0  # drained, nothing resubmitted
    with pytest.raises(ValueError, match="serves"):
        asyncio.run(pool.membership.admit(started("http://10.0.0.5:1", ServedModel(vocab_size=7, num_layers=1, topk=1,
                                                                          num_experts=2, context_length=8))))


def test_a_drain_past_its_bound_resubmits_and_the_last_engine_cannot_leave():
    clients = [StandIn("http://10.0.0.2:1", delay=5.0), StandIn("http://10.0.0.3:1")]
    pool = EnginePool(clients, [Owner(), Owner()])

    async def body():
        busy = asyncio.create_task(pool.generate_batch_counted([[1], [2]], PARAMS, group_ids=["a", "b"]))
        await asyncio.sleep(0.05)
        await pool.membership.remove(0, drain_s=0.1)
        result = await busy
        with pytest.raises(ValueError, match="last one"):
            await pool.membership.remove(1, drain_s=0.1)
        return result

    result = asyncio.run(body())
    assert answers(result.samples) == [("a", [1]), ("b", [2])] and result.resubmitted == 1
    assert pool.membership.states == [GONE, ACTIVE]


class RecordingSync:
    def __init__(self, engines):
        self.engines, self.closed = list(engines), 0

    async def close(self):
        self.closed += 1


def test_the_leave_file_names_engines_by_url_or_node_and_lost_ones_leave_the_sync(tmp_path: Path):
    """Node 10.0.0.3's engine leaves (an unknown URL is ignored), engine 2 is lost: both leave the weight
    sync, whose link is formed again without them; the pool's ceiling drops by the one that left."""
    clients = [StandIn(f"http://10.0.0.{i}:1") for i in (2, 3, 4)]
    pool = EnginePool(clients, [Owner(), Owner(), Owner()])
    sync = RecordingSync(clients)
    membership = Membership(pool, sync, template=SimpleNamespace(nnodes=1), launch={}, run_dir=tmp_path,
                            max_engines=3, drain_s=1.0)
    (tmp_path / LEAVE_FILE).write_text("10.0.0.3\nhttp://10.0.0.9:1\n")
    pool.membership.mark_lost(2, "a test")

    async def body():
        await membership.before_sync()
        return await membership.after_sync()

    metrics = asyncio.run(body())
    assert pool.membership.states == [ACTIVE, GONE, LOST] and not (tmp_path / LEAVE_FILE).exists()
    assert [c.base_url for c in sync.engines] == ["http://10.0.0.2:1"] and sync.closed == 1
    assert metrics == {"rollout/engines": 1.0}
    assert membership.max_engines == 2  # the engine that left is not replaced; the lost one may be
