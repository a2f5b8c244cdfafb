"""Colocated placement: the engines stop generating and release their memory around every training
step. The protocol with stand-ins (order of the calls, the metrics, a sync that fails), the pool's
hold with stand-in engines (nothing in flight, nothing sent while held), and a short real run on
CPU in which no generation request overlaps a training step. On CPU the engines start without
``--enable-memory-saver`` (torch_memory_saver is CUDA-only) and report it, so the run skips the
release: SGLang 0.5.23's ``/release_memory_occupation`` would kill a CPU engine's scheduler (it
ends in ``torch.cuda.synchronize()``)."""
import asyncio
import time

import numpy as np
import pytest
from startup_order import record_startup

from megarl.engines.pool import EnginePool
from megarl.engines.types import PauseMode, SamplingParams, ServedModel
from megarl.metrics.sink import read_metrics
from megarl.pipeline.colocate import Colocation
from megarl.sample import FinishReason, RolloutSample

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)

# --- the protocol, with a stand-in pool ------------------------------------------------------------


class FakePool:
    def __init__(self, can_release: bool):
        self.can_release = can_release
        self.calls: list[str] = []

    async def hold(self, *, abort):
        self.calls.append(f"hold(abort={abort})")

    async def unhold(self):
        self.calls.append("unhold")

    async def memory_release_available(self):
        self.calls.append("available?")
        return self.can_release

    async def release_memory(self, tags):
        self.calls.append(f"release{sorted(tags)}")

    async def resume_memory(self, tags):
        self.calls.append(f"resume{sorted(tags)}")


def _step(colocation: Colocation, pool: FakePool, sync):
    async def body():
        await colocation.before_training()
        pool.calls.append("train")
        return await colocation.after_training(sync)

    return asyncio.run(body())


@pytest.mark.parametrize("abort", [True, False])
def test_release_and_resume_around_the_step_in_order(abort):
    pool = FakePool(can_release=True)
    ticks = iter(range(100))
    colocation = Colocation(pool, abort=abort, clock=lambda: float(next(ticks)))

    async def sync():
        pool.calls.append("sync")
        return {"sync/seconds": 1.0}

    assert _step(colocation, pool, sync) == {"sync/seconds": 1.0}
    assert pool.calls == [f"hold(abort={abort})", "available?", "release['kv_cache', 'weights']", "train",
                          "resume['weights']", "sync", "resume['kv_cache']", "unhold"]
    metrics = colocation.metrics()
    assert metrics["colocate/release_skipped"] == 0.0
    assert metrics["colocate/pause_s"] == 1.0  # one tick: hold .. released
    assert metrics["colocate/resume_s"] == 2.0  # one tick to resume the weights, one for the KV cache + unhold
    pool.calls.clear()
    _step(colocation, pool, sync)
    assert "available?" not in pool.calls  # asked once per run


def test_without_release_the_same_protocol_runs_and_says_it_skipped():
    pool = FakePool(can_release=False)
    colocation = Colocation(pool, abort=False)

    async def sync():
        pool.calls.append("sync")

    _step(colocation, pool, sync)
    assert pool.calls == ["hold(abort=False)", "available?", "train", "sync", "unhold"]
    metrics = colocation.metrics()
    assert metrics["colocate/release_skipped"] == 1.0
    assert metrics["colocate/pause_s"] >= 0 and metrics["colocate/resume_s"] >= 0


def test_a_failing_sync_still_gives_the_engines_back():
    pool = FakePool(can_release=True)
    colocation = Colocation(pool, abort=True)

    async def sync():
        raise RuntimeError("sync broke")

    with pytest.raises(RuntimeError, match="sync broke"):
        _step(colocation, pool, sync)
    assert pool.calls[-2:] == ["resume['kv_cache']", "unhold"]


# --- the pool's hold, with stand-in engines --------------------------------------------------------

MODEL = ServedModel(vocab_size=100, num_layers=2, topk=2, num_experts=8, context_length=64)
PARAMS = SamplingParams(max_new_tokens=4, top_k=5)


class SlowClient:
    """Like SGLang: a request takes ``transit`` s to reach the engine, waits there while the engine
    is paused (where no abort reaches it), then runs ``delay`` s unless aborted (it returns at once,
    finish ``aborted``)."""

    def __init__(self, delay: float, transit: float = 0.0):
        self.model, self.delay, self.transit = MODEL, delay, transit
        self.calls: list[str] = []
        self.sent: list[float] = []
        self._abort = asyncio.Event()
        self._running = asyncio.Event()  # cleared while paused
        self._running.set()

    async def generate_batch(self, prompts, params, *, group_ids, return_routed_experts, return_sampling_mask,
                             prefix_routes=None):
        self.sent.append(time.monotonic())
        await asyncio.sleep(self.transit)
        await self._running.wait()
        self._abort.clear()
        try:
            await asyncio.wait_for(self._abort.wait(), self.delay)
            finish = FinishReason.ABORTED
        except asyncio.TimeoutError:
            finish = FinishReason.STOP
        return [RolloutSample(prompt_ids=p, response_ids=[p[0]], loss_mask=np.ones(1, np.uint8),
                              rollout_logprobs=np.zeros(1, np.float32), model_version=np.zeros(1, np.int32),
                              routed_experts=None, sampling_mask=None, finish_reason=finish, group_id=g)
                for p, g in zip(prompts, group_ids)]

    async def abort_all_requests(self):
        self.calls.append("abort_all")
        self._abort.set()

    async def pause_generation(self, mode):
        self.calls.append(f"pause:{PauseMode(mode).value}")
        self._running.clear()
        if PauseMode(mode) is PauseMode.ABORT:
            self._abort.set()

    async def continue_generation(self):
        self.calls.append("continue")
        self._running.set()


def test_hold_lets_requests_finish_then_sends_nothing_until_unhold():
    client = SlowClient(delay=0.2)
    pool = EnginePool([client])

    async def body():
        running = asyncio.create_task(pool.generate_batch([[1]], PARAMS, group_ids=["a"]))
        await asyncio.sleep(0.02)
        t0 = time.monotonic()
        await pool.hold(abort=False)
        drained_s = time.monotonic() - t0
        assert running.done() and pool.in_flight == [0]
        waiting = asyncio.create_task(pool.generate_batch([[2]], PARAMS, group_ids=["b"]))
        await asyncio.sleep(0.1)
        assert not waiting.done() and len(client.sent) == 1 and pool.held  # not sent while held
        t_unhold = time.monotonic()
        await pool.unhold()
        out = await waiting
        return running.result(), out, drained_s, t_unhold

    first, second, drained_s, t_unhold = asyncio.run(body())
    assert drained_s > 0.1  # waited for the running request
    assert first[0].finish_reason is FinishReason.STOP and second[0].finish_reason is FinishReason.STOP
    assert client.sent[1] >= t_unhold
    assert client.calls == ["pause:retract", "continue"]  # paused only once nothing was running


def test_hold_with_abort_returns_the_running_requests_at_once():
    client = SlowClient(delay=5.0)
    pool = EnginePool([client])

    async def body():
        running = asyncio.create_task(pool.generate_batch([[1]], PARAMS, group_ids=["a"]))
        await asyncio.sleep(0.02)
        t0 = time.monotonic()
        await pool.hold(abort=True)
        held_s = time.monotonic() - t0
        out = await running
        await pool.unhold()
        return out, held_s

    out, held_s = asyncio.run(body())
    assert held_s < 0.3 and out[0].finish_reason is FinishReason.ABORTED
    assert client.calls == ["abort_all", "pause:retract", "continue"]


def test_hold_with_abort_catches_a_request_that_reaches_the_engine_late():
    """A request that left the pool just before the hold reaches the engine after the first abort;
    pausing then would strand it inside the engine until the pause ends (a hold of 600 s, the
    request timeout, before this was handled). It is aborted at the next interval instead."""
    client = SlowClient(delay=5.0, transit=0.1)
    pool = EnginePool([client])

    async def body():
        late = asyncio.create_task(pool.generate_batch([[1]], PARAMS, group_ids=["a"]))
        await asyncio.sleep(0.02)  # sent, not yet at the engine
        t0 = time.monotonic()
        await pool.hold(abort=True, abort_interval_s=0.2)
        held_s = time.monotonic() - t0
        out = await late
        await pool.unhold()
        return out, held_s

    out, held_s = asyncio.run(body())
    assert 0.2 <= held_s < 1.0 and out[0].finish_reason is FinishReason.ABORTED
    assert client.calls == ["abort_all", "abort_all", "pause:retract", "continue"]


class MemoryClient(SlowClient):
    def __init__(self, saver: bool):
        super().__init__(delay=0.0)
        self.saver = saver

    async def memory_saver_enabled(self):
        return self.saver

    async def release_memory(self, tags):
        self.calls.append(f"release:{','.join(tags)}")

    async def resume_memory(self, tags):
        self.calls.append(f"resume:{','.join(tags)}")


def test_pool_release_needs_every_engine_and_resumes_only_what_it_released():
    clients = [MemoryClient(True), MemoryClient(False)]
    pool = EnginePool(clients)

    async def body():
        assert not await pool.memory_release_available()
        clients[1].saver = True
        assert await pool.memory_release_available()
        await pool.release_memory(("kv_cache", "weights"))
        await pool.resume_memory(("weights",))
        pool._engines[1].incarnation = 7  # engine 1 restarted meanwhile: its memory is mapped already
        await pool.resume_memory(("kv_cache",))
        await pool.resume_memory(("kv_cache",))  # nothing left to resume

    asyncio.run(body())
    assert clients[0].calls == ["release:kv_cache,weights", "resume:weights", "resume:kv_cache"]
    assert clients[1].calls == ["release:kv_cache,weights", "resume:weights"]


# --- a short colocated run on CPU -----------------------------------------------------------------


@pytest.fixture(scope="module")
def warm(warmed_up):
    """The warmed-up checkpoint the run starts from (base and warm paths, tests/conftest.py)."""
    return warmed_up.overrides


@pytest.mark.parametrize("partial_rollout", ["continue"])  # abort_resubmit's hold: the fake-engine tests above
def test_no_generation_request_overlaps_a_training_step(tmp_path, warm, monkeypatch, partial_rollout):
    """The recipe's mode (async) stays; every request the engines got (each ``/generate`` the
    driver's clients sent, start to answer, a held-out evaluation's after every step among them) lies outside
    every training step (``rl_step``, start to end), whether the requests in flight run to their end
    (``continue``) or are aborted and continued after the sync (``abort_resubmit``), and the metrics say the
    release was skipped on CPU.
    The engines start once the trainer rank is built (they size their memory by what it left)."""
    from megarl.engines.client import SGLangClient
    from megarl.train import main
    from megarl.trainer.actor import TrainerGroup

    requests: list[tuple[float, float]] = []
    steps: list[tuple[float, float]] = []
    post, rl_step = SGLangClient._post, TrainerGroup.rl_step

    async def timed_post(self, path, payload):
        t0 = time.monotonic()
        try:
            return await post(self, path, payload)
        finally:
            if path == "/generate":
                requests.append((t0, time.monotonic()))

    async def timed_rl_step(self, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return await rl_step(self, *args, **kwargs)
        finally:
            steps.append((t0, time.monotonic()))

    monkeypatch.setattr(SGLangClient, "_post", timed_post)
    monkeypatch.setattr(TrainerGroup, "rl_step", timed_rl_step)
    startup = record_startup(monkeypatch)
    run = tmp_path / "run"
    t0 = time.monotonic()
    assert main(["recipe=tiny_moe_cpu", "placement=colocated", "sync.transport=tensor", "steps=3",
                 "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "warmup.steps=30",
                 f"buffer.partial_rollout={partial_rollout}", f"logging.run_dir={run}", *warm,
                 "eval.interval=1", "eval.prompts=8"]) == 0
    print(f"\n[measured] colocated run of 3 steps ({partial_rollout}): {time.monotonic() - t0:.1f} s, "
          f"{len(requests)} requests")
    assert len(steps) == 3 and len(requests) >= 3
    assert len(startup["launch"]) == 1 and startup["launch"][0] > startup["built"][0], startup
    overlaps = [(r, s) for r in requests for s in steps if r[0] < s[1] and s[0] < r[1]]
    assert not overlaps, overlaps
    rows = [row for row in read_metrics(run) if "reward/mean" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        print(f"[measured] step {row['step']}: reward {row['reward/mean']:.3f}, "
              f"pause {row['colocate/pause_s']:.3f} s, resume {row['colocate/resume_s']:.3f} s, "
              f"release skipped {row['colocate/release_skipped']:.0f}, sync {row['sync/seconds']:.2f} s, "
              f"staleness max {row['staleness/max']}, resubmitted {row.get('buffer/aborted_resubmitted')}")
        assert row["colocate/release_skipped"] == 1.0
        assert 0 <= row["colocate/pause_s"] < 30 and row["colocate/resume_s"] >= 0  # no request stranded
        assert row["sync/version"] == row["step"] and row["staleness/max"] <= 1
        assert 0.0 <= row["reward/mean"] <= 1.0
    assert "mode: async" in (run / "config.yaml").read_text()
    # the held-out evaluation after every step (its requests counted above) ends before the next step trains
    assert [(r["step"], r["eval/weight_version"]) for r in read_metrics(run) if "eval/reward" in r] == \
        [(1, 1.0), (2, 2.0), (3, 3.0)]
