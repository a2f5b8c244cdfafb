"""The rollout buffer, its staleness policy and the sample ledger: every prompt and every sample
attempt ends somewhere, and the totals add up, with stale samples, aborted-and-resubmitted
attempts, failing rewards, filtered groups and whole failed groups injected."""
import asyncio
import dataclasses
from collections import Counter

import numpy as np
import pytest

from megarl.pipeline.buffer import Group, RolloutBuffer, staleness
from megarl.pipeline.ledger import AccountingError, Ledger, Outcome
from megarl.pipeline.producer import ProducerStart, Production, RolloutProducer
from megarl.sample import FinishReason, RolloutSample
from megarl.tasks.prompts import BadPrompt

pytestmark = pytest.mark.unit


def sample(versions, reward=1.0, finish=FinishReason.STOP):
    r = len(versions)
    s = RolloutSample(prompt_ids=[1, 2], response_ids=[3] * r, loss_mask=np.ones(r, np.uint8),
                      rollout_logprobs=np.zeros(r, np.float32), model_version=np.asarray(versions, np.int32),
                      routed_experts=None, sampling_mask=None, finish_reason=finish)
    s.reward = reward
    return s


@dataclasses.dataclass
class Prompt:
    text: str


class CountingSource:
    def __init__(self):
        self.position = 0

    def next_batch(self, n):
        out = [Prompt(f"p{self.position + i}") for i in range(n)]
        self.position += n
        return out

    def state_dict(self):
        return {"position": self.position}


@dataclasses.dataclass
class Result:
    samples: list
    resubmitted: int


class ScriptedManager:
    """Plays a fixed script per prompt: (versions per sample, rewards, errors, resubmitted, raise)."""

    def __init__(self, script):
        self.script = script
        self.calls = Counter()
        self.version = 0  # the engines' weight version, stamped on every generated token

    async def generate_group(self, prompt, group_id):
        self.calls[prompt.text] += 1
        kind = self.script(int(prompt.text[1:]))
        await asyncio.sleep(0)
        if kind == "engine_failed":
            raise RuntimeError("engine unreachable after restarts")
        v = self.version
        samples = [sample([v, v], reward=float(i % 2)) for i in range(4)]
        resubmitted = 0
        if kind == "stale":
            samples = [sample([v - 5, v], reward=float(i % 2)) for i in range(4)]
        elif kind == "reward_raises":
            samples[0].finish_reason = FinishReason.ERROR
            samples[0].reward = 0.0
        elif kind == "aborted_twice":
            resubmitted = 2
        elif kind == "all_equal":
            for s in samples:
                s.reward = 1.0
        elif kind == "all_errors":
            for s in samples:
                s.finish_reason = FinishReason.ERROR
        return Result(samples, resubmitted)


def test_staleness_is_trainer_version_minus_the_oldest_token():
    assert staleness(sample([3, 4, 5]), 6) == 3
    assert Group(0, [sample([5]), sample([2, 6])]).staleness(6) == 4


def test_ledger_refuses_counts_that_do_not_add_up():
    ledger = Ledger()
    ledger.started(1, 4)
    ledger.returned(1, 3, 1)
    ledger.check()
    ledger.samples.buffered += 1  # a sample counted twice
    with pytest.raises(AccountingError, match="samples: started 4"):
        ledger.check()


def test_every_prompt_and_attempt_ends_somewhere_and_the_totals_add_up():
    kinds = {1: "stale", 2: "reward_raises", 3: "aborted_twice", 4: "all_equal", 5: "engine_failed",
             6: "all_errors", 9: "stale", 11: "reward_raises"}
    manager = ScriptedManager(lambda i: kinds.get(i, "ok"))
    ledger = Ledger()
    steps, per_step = 4, 3

    async def run():
        buffer = RolloutBuffer(capacity=2 * per_step, max_staleness=1, ledger=ledger)
        production = Production(prompts_per_step=per_step, samples_per_prompt=4, lag=1, dynamic_sampling=True)
        producer = RolloutProducer(manager, CountingSource(), buffer, ledger, production)
        task = asyncio.create_task(producer.run())
        trained = []
        for step in range(1, steps + 1):
            taken = await buffer.take(per_step, trainer_version=step - 1)
            producer.taken(taken.groups + taken.dropped_stale)
            assert all(age <= 1 for age in taken.staleness)
            trained += [g.index for g in taken.groups]
            ledger.check()
            manager.version = step
            await producer.set_engine_version(step)
        task.cancel()
        await producer.stop()
        return trained, producer

    trained, producer = asyncio.run(run())
    ledger.check()
    assert len(trained) == steps * per_step and len(set(trained)) == len(trained)  # none trained twice
    assert not {1, 4, 5, 6, 9} & set(trained)  # stale, filtered, failed groups never trained
    s, p = ledger.samples.ended, ledger.prompts.ended
    assert s[Outcome.TRAINED] == 4 * len(trained) - sum(1 for i in trained if kinds.get(i) == "reward_raises")
    assert s[Outcome.DROPPED_STALE] == 4 * 2 and p[Outcome.DROPPED_STALE] == 2  # prompts 1 and 9
    assert s[Outcome.DROPPED_FILTER] == 4 and p[Outcome.DROPPED_FILTER] == 1  # prompt 4
    assert s[Outcome.ABORTED_RESUBMITTED] == 2  # prompt 3's two aborted attempts
    assert s[Outcome.ERROR] == 1 + 1 + 4 + 4  # two raising rewards, prompt 5 failed, prompt 6 all errors
    assert p[Outcome.ERROR] == 2 and p[Outcome.TRAINED] == len(trained)
    assert ledger.samples.started == 4 * ledger.prompts.started + 2
    assert max(manager.calls.values()) == 1  # no prompt generated twice
    # what is still outstanding is exactly what was drawn and not finished: re-queued on resume
    finished = set(trained) | {1, 4, 5, 6, 9}
    state = producer.position()
    assert {i for i, _ in state["requeue"]} == set(range(state["next_index"])) - finished
    restored = Ledger.from_state_dict(ledger.state_dict())
    assert restored.samples.ended == ledger.samples.ended and restored.samples.in_flight == 0


def test_sync_lag_waits_for_the_weights_of_the_previous_step():
    manager = ScriptedManager(lambda i: "ok")
    ledger = Ledger()

    async def run():
        buffer = RolloutBuffer(capacity=4, max_staleness=0, ledger=ledger)
        production = Production(prompts_per_step=2, samples_per_prompt=4, lag=0, dynamic_sampling=False)
        producer = RolloutProducer(manager, CountingSource(), buffer, ledger, production)
        task = asyncio.create_task(producer.run())
        await buffer.take(2, trainer_version=0)
        for _ in range(20):
            await asyncio.sleep(0)
        started_before_sync = ledger.prompts.started  # the next batch waits for version 1
        await producer.set_engine_version(1)
        for _ in range(20):
            await asyncio.sleep(0)
        task.cancel()
        await producer.stop()
        return started_before_sync, ledger.prompts.started

    before, after = asyncio.run(run())
    assert before == 2 and after == 4


async def take_once(manager, source, ledger: Ledger, groups: int):
    """One ``buffer.take`` of ``groups`` groups from a producer running ``manager`` over ``source``
    (through ``producer.guard``: a production failure raises here); returns (taken, producer)."""
    buffer = RolloutBuffer(capacity=4, max_staleness=0, ledger=ledger)
    production = Production(prompts_per_step=groups, samples_per_prompt=4, lag=0, dynamic_sampling=False)
    producer = RolloutProducer(manager, source, buffer, ledger, production)
    task = asyncio.create_task(producer.run())
    try:
        return await asyncio.wait_for(producer.guard(buffer.take(groups, trainer_version=0)), 30), producer
    finally:
        task.cancel()
        await producer.stop()


def test_a_run_whose_every_group_fails_stops_with_the_reason():
    from megarl.pipeline.producer import GenerationFailing

    ledger = Ledger()
    with pytest.raises(GenerationFailing, match="the last 64 prompt groups all failed"):
        asyncio.run(take_once(ScriptedManager(lambda i: "all_errors"), CountingSource(), ledger, 2))
    assert ledger.prompts.ended[Outcome.ERROR] >= 64


def test_a_run_whose_every_group_raises_stops_with_the_error():
    from megarl.pipeline.producer import GenerationFailing

    ledger = Ledger()
    with pytest.raises(GenerationFailing, match="the last 64 prompt groups all failed .last: RuntimeError: engine unr"):
        asyncio.run(take_once(ScriptedManager(lambda i: "engine_failed"), CountingSource(), ledger, 2))
    assert ledger.prompts.ended[Outcome.ERROR] >= 64


class SourceWithBadRows(CountingSource):
    """Every third draw is a row that is no prompt; ``broken_after`` draws, the source itself fails."""

    def __init__(self, broken_after=None):
        super().__init__()
        self.draws, self.broken_after = 0, broken_after

    def next_batch(self, n):
        self.draws += 1
        if self.broken_after is not None and self.draws > self.broken_after:
            raise OSError("the dataset's disk went away")
        if self.draws % 3 == 0:
            raise BadPrompt(f"row {self.draws} is no prompt")
        return super().next_batch(n)


def test_rows_that_are_no_prompt_are_counted_and_production_goes_on():
    ledger = Ledger()
    taken, producer = asyncio.run(take_once(ScriptedManager(lambda i: "ok"), SourceWithBadRows(), ledger, 4))
    bad = producer.bad_prompts
    assert len(taken.groups) == 4 and bad >= 1  # draw 3 was a bad row; 1, 2, 4 and 5 made the batch
    assert ledger.prompts.ended[Outcome.ERROR] == bad and ledger.samples.ended[Outcome.ERROR] == 0
    ledger.check()


class SourceOfBadRows(CountingSource):
    """No row is a prompt."""

    def next_batch(self, n):
        raise BadPrompt("row 7 has no string 'prompt' (got NoneType)")


def test_a_source_of_nothing_but_bad_rows_fails_the_run_instead_of_spinning():
    from megarl.pipeline.producer import GenerationFailing

    ledger = Ledger()
    with pytest.raises(GenerationFailing, match=r"the last 64 prompt groups all failed \(last: row 7 has no string"):
        asyncio.run(take_once(ScriptedManager(lambda i: "ok"), SourceOfBadRows(), ledger, 2))
    assert ledger.prompts.ended[Outcome.ERROR] >= 64


def test_a_source_that_fails_fails_the_run_instead_of_hanging_it():
    with pytest.raises(OSError, match="the dataset's disk went away"):
        asyncio.run(take_once(ScriptedManager(lambda i: "ok"), SourceWithBadRows(broken_after=1), Ledger(), 2))


def _full_sample(seed: int) -> RolloutSample:
    """A sample with every optional per-token record set (routes, mask, mixed flags, advantages)."""
    from megarl.sample import SamplingMask

    rng = np.random.default_rng(seed)
    r = 3
    return RolloutSample(
        prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=np.array([1, 0, 1], np.uint8),
        rollout_logprobs=rng.normal(size=r).astype(np.float32), model_version=np.array([0, 1, 1], np.int32),
        routed_experts=rng.integers(0, 8, (4, 2, 2)).astype(np.int16), sampling_mask=SamplingMask(
            np.array([3, 7, 4, 5, 6], np.int32), np.array([0, 2, 3, 5], np.int32),
            rng.normal(size=5).astype(np.float32)), finish_reason=FinishReason.ABORTED, reward=0.5, advantage=-1.0,
        group_id="7", episode_id="7.1", turn_ends=(1, 3), turn_rewards=(0.1, 0.2), episode_end="done",
        token_advantages=rng.normal(size=r).astype(np.float32), teacher_logprobs=rng.normal(size=r).astype(np.float32),
        role="solver", tool_calls={"add": 2}, mixed_versions=np.array([False, True, True]), prefill_tokens=9,
        cached_tokens=4)


def _equal(a: RolloutSample, b: RolloutSample) -> bool:
    for f in dataclasses.fields(RolloutSample):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "sampling_mask":
            x, y = [[m.ids.tolist(), m.offsets.tolist(), None if m.logprobs is None else m.logprobs.tolist()]
                    for m in (x, y)]
        elif isinstance(x, np.ndarray):
            if x.dtype != y.dtype or not np.array_equal(x, y):
                return False
            continue
        if x != y:
            return False
    return True


def test_a_checkpoint_carries_every_per_token_record_of_its_samples():
    from megarl import sample as sample_module
    from megarl.pipeline.carried import CarriedRollouts, PartialEntry
    from megarl.rollout.group import PartialGroup
    from megarl.sample import samples_from_bytes, samples_to_bytes
    from megarl.tasks.prompts import Prompt as TaskPrompt

    stored = set(sample_module._ARRAYS) | set(sample_module._JSON) | {"sampling_mask", "finish_reason"}
    assert stored == {f.name for f in dataclasses.fields(RolloutSample)}  # a new field is stored, or this fails
    samples = [_full_sample(i) for i in range(3)]
    assert all(_equal(a, b) for a, b in zip(samples, samples_from_bytes(samples_to_bytes(samples))))
    carried = CarriedRollouts([Group(4, samples[:1])], [PartialEntry(6, TaskPrompt("2+2=", "4"),
                                                                     PartialGroup(samples[1:], resubmitted=3))])
    back, prompts = CarriedRollouts.from_plain(carried.to_plain({4: TaskPrompt("1+1=", "2")}))
    assert prompts == {4: TaskPrompt("1+1=", "2")} and back.indices == {4, 6}
    assert [g.index for g in back.buffered] == [4] and _equal(back.buffered[0].samples[0], samples[0])
    [entry] = back.partial
    assert (entry.index, entry.prompt, entry.group.resubmitted) == (6, TaskPrompt("2+2=", "4"), 3)
    assert all(_equal(a, b) for a, b in zip(entry.group.samples, samples[1:]))


class CarryingManager(ScriptedManager):
    """A ScriptedManager that continues a carried group: its samples as they were, the later ones' versions."""

    def __init__(self):
        super().__init__(lambda i: "ok")
        self.carried = {}

    async def generate_group(self, prompt, group_id, carried=None):
        if carried is None:
            return await super().generate_group(prompt, group_id)
        self.carried[group_id] = carried
        return Result(list(carried.samples), carried.resubmitted)


def test_a_resumed_producer_takes_the_carried_groups_back_before_drawing_new_prompts():
    """A checkpoint at a moment with one group buffered (prompt 0) and one in flight (prompt 1, its samples
    so far recorded) and one in flight with nothing back (prompt 2): the resumed run trains 0 and 1 from the
    carried samples, draws 2 again, and the ledger adds up across the restart."""
    from megarl.pipeline.carried import CarriedRollouts, PartialEntry
    from megarl.rollout.group import PartialGroup

    ledger = Ledger()
    ledger.started(3, 12)
    ledger.returned(1, 4, 0)  # prompt 0 buffered, prompts 1 and 2 in flight
    partial = PartialGroup([sample([0, 0]) for _ in range(4)], resubmitted=2)
    carried = CarriedRollouts([Group(0, [sample([0]) for _ in range(4)])], [PartialEntry(1, Prompt("p1"), partial)])
    outstanding = {0: Prompt("p0"), 1: Prompt("p1"), 2: Prompt("p2")}

    async def position():
        production = Production(prompts_per_step=2, samples_per_prompt=4, lag=1, dynamic_sampling=False)
        start = ProducerStart(requeue=outstanding.items(), next_index=3)
        buffer = RolloutBuffer(4, 1, ledger)
        producer = RolloutProducer(ScriptedManager(lambda i: "ok"), CountingSource(), buffer, ledger, production, start)
        return producer.position(carried)

    state = asyncio.run(position())
    assert state["requeue"] == [[2, {"text": "p2"}]]
    resumed_ledger = Ledger.from_state_dict(state["ledger"])
    assert (resumed_ledger.prompts.buffered, resumed_ledger.prompts.in_flight) == (1, 1)
    assert (resumed_ledger.samples.buffered, resumed_ledger.samples.in_flight) == (4, 4)
    assert resumed_ledger.prompts.started == 2 and resumed_ledger.samples.started == 8  # prompt 2 not started

    manager = CarryingManager()

    async def resumed():
        buffer = RolloutBuffer(4, 1, resumed_ledger)
        back = CarriedRollouts.from_plain(state["carried"])
        requeue = [(i, Prompt(**p)) for i, p in state["requeue"]]
        source = CountingSource()
        source.position = state["next_index"]  # new prompts p3, p4, ...
        production = Production(prompts_per_step=2, samples_per_prompt=4, lag=1, dynamic_sampling=False)
        start = ProducerStart(requeue=requeue, next_index=state["next_index"], carried=(back[0], {0: Prompt("p0")}))
        producer = RolloutProducer(manager, source, buffer, resumed_ledger, production, start)
        task = asyncio.create_task(producer.run())
        taken = await buffer.take(2, trainer_version=1)
        producer.taken(taken.groups)
        more = await buffer.take(1, trainer_version=1)
        task.cancel()
        await producer.stop()
        return [g.index for g in taken.groups + more.groups]

    assert asyncio.run(resumed()) == [0, 1, 2]
    assert manager.carried["1"].resubmitted == 2  # group 1 continued from its carried samples
    assert manager.calls["p2"] == 1 and not manager.calls["p0"] and not manager.calls["p1"]  # 0, 1 not generated
    resumed_ledger.check()
    assert resumed_ledger.samples.ended[Outcome.ABORTED_RESUBMITTED] == 2  # the carried group's, counted once


class PausingPool:
    """The policy pool's pause and continue, recorded; while paused the manager's requests come back."""

    def __init__(self, manager):
        self.manager, self.calls = manager, []

    async def pause(self, mode):
        self.calls.append(("pause", mode))
        self.manager.pending = 0  # the aborted requests answer

    async def continue_generation(self):
        self.calls.append(("continue",))


class InFlightManager:
    """What carry() reads of a rollout manager: single-turn groups in flight and their requests."""

    episodes = None

    def __init__(self, in_flight):
        self.in_flight, self.pending, self.marks = in_flight, 1, []

    def mark(self):
        self.marks.append(len(self.marks))
        return self.marks[-1]

    async def returned(self, mark, timeout_s):
        await asyncio.sleep(0)
        return self.pending == 0


def test_a_checkpoint_reads_the_groups_in_flight_through_one_abort_pause_and_lets_them_go_on():
    from megarl.engines.types import PauseMode
    from megarl.rollout.group import PartialGroup

    ledger = Ledger()
    ledger.started(3, 12)
    ledger.returned(1, 4, 0)  # prompt 0 buffered; 1 in flight with samples back, 2 with none back yet
    manager = InFlightManager({"1": PartialGroup([sample([0]) for _ in range(4)], resubmitted=4)})
    pool = PausingPool(manager)

    async def carry():
        buffer = RolloutBuffer(4, 1, ledger)
        buffer.restore([Group(0, [sample([0]) for _ in range(4)])], reserved=2)
        production = Production(prompts_per_step=2, samples_per_prompt=4, lag=1, dynamic_sampling=False)
        start = ProducerStart(requeue=[(0, Prompt("p0")), (1, Prompt("p1")), (2, Prompt("p2"))], next_index=3)
        producer = RolloutProducer(manager, CountingSource(), buffer, ledger, production, start)
        return await producer.carry(pool)

    position = asyncio.run(carry())
    assert pool.calls == [("pause", PauseMode.ABORT), ("continue",)] and manager.marks == [0]
    assert position["requeue"] == [[2, {"text": "p2"}]]  # nothing of it came back: generated anew
    carried = position["carried"]
    assert [g[0] for g in carried["buffered"]] == [0] and [p[0] for p in carried["partial"]] == [1]
    samples = position["ledger"]["samples"]
    assert (samples["started"], samples["in_flight"], samples["buffered"]) == (8, 4, 4)
