"""The engine pool: least-loaded placement and resubmission (with stand-in engines), then one real
SGLang server under a Ray EngineActor: generation through the pool, and killing the server
mid-batch, after which the actor restarts it and the pool resubmits: every prompt exactly once."""
import asyncio
import os
import signal
import time

import numpy as np
import psutil
import pytest

from megarl.engines.actor import EngineInfo, WatchdogSettings
from megarl.engines.pool import EnginePool
from megarl.engines.server import EngineSettings
from megarl.engines.types import EngineError, EngineUnreachable, PauseMode, SamplingParams, ServedModel
from megarl.sample import FinishReason, RolloutSample

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)

MODEL = ServedModel(vocab_size=100, num_layers=2, topk=2, num_experts=8, context_length=64)


class FakeClient:
    """Answers each prompt with one token (the prompt's first id) after ``delay`` s; the first
    ``fail_times`` requests raise EngineUnreachable after half the delay, like a dying server."""

    def __init__(self, delay=0.05, fail_times=0):
        self.model, self.delay, self.fail_times = MODEL, delay, fail_times
        self.requests: list[list[str]] = []
        self.routes: list = []  # each request's prefix routes
        self.calls: list[str] = []

    async def generate_batch(self, prompts, params, *, group_ids, return_routed_experts=True,
                             return_sampling_mask=True, prefix_routes=None):
        self.requests.append(list(group_ids))
        self.routes.append(prefix_routes)
        if self.fail_times > 0:
            self.fail_times -= 1
            await asyncio.sleep(self.delay / 2)
            raise EngineUnreachable("connection reset (stand-in)")
        await asyncio.sleep(self.delay)
        return [RolloutSample(prompt_ids=p, response_ids=[p[0]], loss_mask=np.ones(1, np.uint8),
                              rollout_logprobs=np.zeros(1, np.float32), model_version=np.zeros(1, np.int32),
                              routed_experts=None, sampling_mask=None, finish_reason=FinishReason.STOP, group_id=g)
                for p, g in zip(prompts, group_ids)]

    async def pause_generation(self, mode):
        self.calls.append(f"pause:{PauseMode(mode).value}")

    async def continue_generation(self):
        self.calls.append("continue")


class FakeSupervisor:
    def __init__(self):
        self.incarnation = 0

    async def ensure_healthy(self):
        self.incarnation += 1  # every call finds the engine restarted
        return EngineInfo(url="fake", pid=None, incarnation=self.incarnation, restarts=self.incarnation, alive=True)


PARAMS = SamplingParams(max_new_tokens=4, top_k=5)


def test_least_loaded_placement():
    clients = [FakeClient(delay=0.3), FakeClient(delay=0.05)]
    pool = EnginePool(clients)

    async def body():
        busy = asyncio.create_task(pool.generate_batch([[1]] * 3, PARAMS, group_ids=["b0", "b1", "b2"]))
        await asyncio.sleep(0.01)
        assert pool.in_flight == [2, 1]  # prompt by prompt to the least loaded, ties to the lower index
        await asyncio.sleep(0.1)
        assert pool.in_flight == [2, 0]  # the fast engine answered
        out = await pool.generate_batch([[i + 10] for i in range(5)], PARAMS, group_ids=[f"g{i}" for i in range(5)])
        await busy
        return out

    out = asyncio.run(body())
    # load [2, 0]: g0, g1 -> engine 1; tie [2, 2]: g2 -> engine 0; g3 -> engine 1; tie: g4 -> engine 0.
    assert clients[0].requests == [["b0", "b2"], ["g2", "g4"]]
    assert clients[1].requests == [["b1"], ["g0", "g1", "g3"]]
    assert [s.group_id for s in out] == [f"g{i}" for i in range(5)]  # prompt order kept
    assert [s.response_ids for s in out] == [[i + 10] for i in range(5)]
    assert pool.in_flight == [0, 0]


def test_each_prompt_s_prefix_routes_go_with_it_to_its_engine():
    clients = [FakeClient(), FakeClient()]
    routes = [np.full((1, 2, 2), i, np.int16) for i in range(3)]

    async def body():
        await EnginePool(clients).generate_batch([[i, i] for i in range(3)], PARAMS, group_ids=["a", "b", "c"],
                                                 prefix_routes=[routes[0], None, routes[2]])

    asyncio.run(body())
    assert clients[0].requests == [["a", "c"]] and clients[1].requests == [["b"]]
    assert [r[0, 0, 0] for r in clients[0].routes[0]] == [0, 2] and clients[1].routes == [[None]]


def test_lost_request_is_resubmitted_after_the_restart_exactly_once():
    clients = [FakeClient(fail_times=1), FakeClient()]
    restarts = []

    async def on_restart(index, client, info):
        restarts.append((index, info.incarnation, list(client.calls)))

    pool = EnginePool(clients, [FakeSupervisor(), FakeSupervisor()], on_restart=on_restart)

    async def body():
        await pool.pause(PauseMode.RETRACT)
        task = asyncio.create_task(pool.generate_batch_counted([[i] for i in range(6)], PARAMS,
                                                               group_ids=[str(i) for i in range(6)]))
        await asyncio.sleep(0.04)  # engine 0 fails at 0.025 s, while the pool is paused
        await pool.continue_generation()
        return await task

    result = asyncio.run(body())
    assert [s.group_id for s in result.samples] == [str(i) for i in range(6)]
    assert [s.response_ids for s in result.samples] == [[i] for i in range(6)]
    assert result.resubmitted == 3 and pool.resubmitted == 3  # engine 0 held prompts 0, 2, 4
    # the restarted engine was re-paused (the pool was paused) before the hook and the resubmission
    assert restarts == [(0, 1, ["pause:retract", "pause:retract"])]
    answered = [g for c in clients for r in c.requests for g in r]
    assert sorted(answered) == sorted([str(i) for i in range(6)] + ["0", "2", "4"])


def test_an_engine_that_always_loses_the_request_is_an_error():
    pool = EnginePool([FakeClient(fail_times=10)], [FakeSupervisor()], max_attempts=3)
    with pytest.raises(EngineError, match="lost 2 prompts 3 times") as error:
        asyncio.run(pool.generate_batch([[1], [2]], PARAMS, group_ids=["a", "b"]))
    assert not isinstance(error.value, EngineUnreachable)  # a poison request, not a lost engine
    with pytest.raises(EngineUnreachable, match="stand-in"):  # nobody to restart it: the engine is gone
        asyncio.run(EnginePool([FakeClient(fail_times=1)]).generate_batch([[1]], PARAMS, group_ids=["a"]))


def test_a_subset_places_and_resubmits_among_its_engines_only():
    clients = [FakeClient(), FakeClient(fail_times=1), FakeClient()]
    pool = EnginePool(clients, [FakeSupervisor() for _ in clients])
    subset = pool.subset([1, 2])
    assert subset.indices == [1, 2] and subset.model == pool.model

    result = asyncio.run(subset.generate_batch_counted([[i] for i in range(4)], PARAMS,
                                                       group_ids=[str(i) for i in range(4)]))
    assert [s.group_id for s in result.samples] == [str(i) for i in range(4)]
    assert [s.response_ids for s in result.samples] == [[i] for i in range(4)]
    # engine 1 lost its first request (prompts 0, 2) while engine 2 still held two; the idle engine 0
    # (the pool's least loaded, and the lowest index) got neither the batch nor the resubmission
    assert clients[0].requests == []
    assert clients[1].requests == [["0", "2"], ["0", "2"]] and clients[2].requests == [["1", "3"]]
    assert result.resubmitted == 2 and pool.resubmitted == 2
    assert pool.in_flight == [0, 0, 0]
    assert asyncio.run(pool.generate_batch([[7]], PARAMS, group_ids=["all"]))[0].response_ids == [7]
    assert clients[0].requests == [["all"]]  # the pool itself still places on every engine


@pytest.mark.parametrize("indices", [[], [0, 0], [3], [-1]])
def test_a_subset_of_engines_the_pool_does_not_have_is_refused(indices):
    with pytest.raises(ValueError, match=r"distinct, at least one, each in \[0, 3\)"):
        EnginePool([FakeClient() for _ in range(3)]).subset(indices)


def test_an_episodes_next_turn_goes_to_the_engine_that_served_its_last():
    clients = [FakeClient(), FakeClient()]
    pool = EnginePool(clients)
    keys = ["e0", "e1", "e2", "e3"]

    async def body():
        await pool.generate_batch([[1]] * 4, PARAMS, group_ids=keys, affinity=keys)  # least-loaded: 0 1 0 1
        # the next turns in another order: least-loaded alone would put e3 and e1 on engine 0
        await pool.generate_batch([[2]] * 4, PARAMS, group_ids=keys[::-1], affinity=keys[::-1])
        await pool.generate_batch([[3]] * 2, PARAMS, group_ids=["x", "y"])  # no keys: least-loaded

    asyncio.run(body())
    assert clients[0].requests == [["e0", "e2"], ["e2", "e0"], ["x"]]
    assert clients[1].requests == [["e1", "e3"], ["e3", "e1"], ["y"]]
    assert (pool.affinity.kept, pool.affinity.moved) == (4, 0)


def test_a_turn_leaves_an_engine_busier_than_the_slack():
    clients = [FakeClient(delay=0.3), FakeClient(delay=0.05)]
    pool = EnginePool(clients, affinity_slack=1)

    async def body():
        await pool.generate_batch([[1]], PARAMS, group_ids=["e"], affinity=["e"])  # engine 0 (tie)
        busy = asyncio.create_task(pool.generate_batch([[1]] * 3, PARAMS, group_ids=["b0", "b1", "b2"]))
        await asyncio.sleep(0.1)  # engine 0 holds b0, b2; engine 1 answered b1: 2 > 0 + slack
        await pool.generate_batch([[2]], PARAMS, group_ids=["e"], affinity=["e"])
        await pool.generate_batch([[3]], PARAMS, group_ids=["e"], affinity=["e"])  # stays where it moved
        await busy

    asyncio.run(body())
    assert clients[0].requests == [["e"], ["b0", "b2"]]
    assert clients[1].requests == [["b1"], ["e"], ["e"]]
    assert (pool.affinity.kept, pool.affinity.moved) == (1, 1)


def test_affinity_keys_are_checked_and_bounded():
    from megarl.engines.affinity import EngineAffinity

    pool = EnginePool([FakeClient()])
    with pytest.raises(ValueError, match="2 prompts but 1 affinity keys"):
        asyncio.run(pool.generate_batch([[1], [2]], PARAMS, group_ids=["a", "b"], affinity=["a"]))
    with pytest.raises(ValueError, match="slack must be >= 0"):
        EngineAffinity(-1)

    class Engine:
        def __init__(self, index):
            self.index, self.in_flight = index, 0

    engines = [Engine(0), Engine(1)]
    affinity = EngineAffinity(slack=0, capacity=2)
    affinity.place(engines, [0, 1, 2], ["a", "b", "c"])  # a -> 0, b -> 1, c -> 0; a is forgotten
    engines[0].in_flight = 2
    placed = affinity.place(engines, [0, 1], ["a", "c"])  # a: least-loaded (1); c: its engine 0 is 1 busier
    assert [(e.index, part) for e, part in placed] == [(1, [0, 1])]
    assert (affinity.kept, affinity.moved) == (0, 1)


# --- one real engine under a Ray actor ------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(ray_local, tiny_checkpoint, tmp_path_factory, loop):
    settings = EngineSettings(model_path=tiny_checkpoint, dtype="float32", max_total_tokens=4096,
                              log_path=str(tmp_path_factory.mktemp("sglang_pool") / "server.log"))
    t0 = time.monotonic()
    pool = loop.run_until_complete(EnginePool.launch([settings], watchdog=WatchdogSettings(poll_interval_s=0.2)))
    print(f"\n[measured] engine actor start-up {time.monotonic() - t0:.1f} s")
    yield pool
    loop.run_until_complete(pool.aclose())


def engine_info(pool) -> EngineInfo:
    import ray

    return ray.get(pool.actors[0].info.remote())


def test_pool_generates_and_controls_the_engine(pool, loop):
    params = SamplingParams(max_new_tokens=8, top_k=10)

    async def body():
        samples = await pool.generate_batch([[1, 5, 6], [1, 7]], params, group_ids=["a", "b"])
        await pool.pause(PauseMode.IN_PLACE)
        await pool.continue_generation()
        return samples, await pool.weight_version()

    samples, version = loop.run_until_complete(body())
    assert [s.group_id for s in samples] == ["a", "b"] and version == 0
    for s in samples:
        assert s.routed_experts.shape[0] == s.num_tokens - 1 and s.sampling_mask.num_rows == len(s.response_ids)


def test_killing_the_server_mid_batch_restarts_it_and_loses_no_sample(pool, loop):
    n, params = 64, SamplingParams(max_new_tokens=56, top_k=10, ignore_eos=True)  # 3.8k of the 4k KV tokens
    before = engine_info(pool)
    old_group = [p.pid for p in psutil.process_iter() if _pgid(p) == before.pid]

    async def body():
        task = asyncio.create_task(pool.generate_batch_counted(
            [[1, 2 + i % 9, 3] for i in range(n)], params, group_ids=[f"p{i}" for i in range(n)]))
        while pool.in_flight != [n] and not task.done():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # in the engine (a kill before it is as good: every prompt is resubmitted)
        assert not task.done(), "the batch finished before the kill: the test would prove nothing"
        os.kill(before.pid, signal.SIGKILL)
        t0 = time.monotonic()
        result = await asyncio.wait_for(task, timeout=240)
        return result, time.monotonic() - t0

    result, recovery_s = loop.run_until_complete(body())
    after = engine_info(pool)
    assert after.restarts == 1 and after.incarnation == before.incarnation + 1 and after.alive
    assert after.pid != before.pid and after.url == before.url
    assert result.resubmitted == n and pool.resubmitted >= n
    ids = [s.group_id for s in result.samples]
    assert ids == [f"p{i}" for i in range(n)]  # every prompt once, in order: none lost, none duplicated
    assert all(s.finish_reason is FinishReason.LENGTH and len(s.response_ids) == 56 for s in result.samples)
    psutil.wait_procs([psutil.Process(p) for p in old_group if psutil.pid_exists(p)], timeout=30)
    assert [p.pid for p in psutil.process_iter() if _pgid(p) == before.pid] == []  # no orphan of the old server
    print(f"\n[measured] kill mid-batch: {n} prompts resubmitted, all {n} samples back "
          f"{recovery_s:.1f} s after the kill (restart included)")


def test_stop_leaves_no_server_process(pool, loop):
    """Last in the module: closing the pool stops the actor's server, its whole process group."""
    pid = engine_info(pool).pid
    group = [p for p in psutil.process_iter() if _pgid(p) == pid]
    assert len(group) >= 2  # leader + scheduler/detokenizer
    loop.run_until_complete(pool.aclose())
    psutil.wait_procs(group, timeout=30)  # SIGKILLed children are reaped by init, a moment later
    assert [p.pid for p in psutil.process_iter() if _pgid(p) == pid] == []


def _pgid(process):
    try:
        return os.getpgid(process.pid)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return None
