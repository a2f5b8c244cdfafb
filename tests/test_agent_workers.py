"""Agent episodes in agent workers (``megarl/agents/workers.py``: Ray actors, the gateway reached over the
network with each session's credential) on the shared tiny SGLang engine (CPU): the samples are those of
the in-driver mode, field for field (greedy, a flushed prefix cache before each mode), for an ``async def``
and a plain agent (the plain one in the driver too); an agent that blocks its event loop stalls no other
episode in a worker (it does in the driver); failing agents end as the same counted errors, plus an
unpicklable result and a worker that died."""
import asyncio
import dataclasses
import time

import numpy as np
import pytest
import ray

from megarl.agents.gateway import AgentGateway, GatewaySettings
from megarl.agents.rollout import AgentEpisodes
from megarl.agents.spec import load_agent
from megarl.agents.workers import AgentWorkers, agent_spec
from megarl.engines.types import GenerationOptions, SamplingParams
from megarl.parallel.network import node_address
from megarl.sample import FinishReason
from megarl.tasks.prompts import Prompt

GREEDY = SamplingParams(max_new_tokens=4, top_k=5, temperature=0.0)


@pytest.fixture(scope="module")
def workers(ray_local, loop):
    """One agent worker (four episodes at once) for the module, reserving no CPU of the shared Ray."""
    pool = AgentWorkers(1, cpus=0, episodes_per_worker=4)
    yield pool
    loop.run_until_complete(pool.aclose())


def episodes(target, tokenizer, agent, workers=None, params=GREEDY, timeout_s=60.0):
    settings = GatewaySettings(max_turns=3, max_response_tokens=40, host=node_address() if workers else "127.0.0.1")
    gateway = AgentGateway(target, tokenizer, GenerationOptions(params), settings)
    return AgentEpisodes(gateway, load_agent(f"agent_examples:{agent}"), timeout_s=timeout_s, workers=workers)


def run_all(loop, agents, prompts):
    """Each prompt's episode, one after the other (the engine's batches as in the other mode)."""
    async def body():
        try:
            return [await agents.run(p, "g", f"ep{i}") for i, p in enumerate(prompts)]
        finally:
            await agents.aclose()

    return loop.run_until_complete(body())


def assert_same(a, b, where=""):
    """Every field of two samples (or sampling masks) equal: arrays element for element."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            assert_same(x, y, f"{where}{f.name}.")
        elif isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype, f"{where}{f.name}"
            np.testing.assert_array_equal(x, y, err_msg=f"{where}{f.name}")
        else:
            assert x == y, f"{where}{f.name}: {x!r} != {y!r}"


def test_worker_episodes_are_the_in_driver_ones(client, tokenizer, workers, loop):
    prompts = [Prompt("3+4="), Prompt("5+1=")]
    loop.run_until_complete(client.flush_cache())
    in_driver = run_all(loop, episodes(client, tokenizer, "three_turns"), prompts)
    for agent, pool in (("three_turns_sync", None), ("three_turns", workers), ("three_turns_sync", workers)):
        loop.run_until_complete(client.flush_cache())
        other = run_all(loop, episodes(client, tokenizer, agent, pool), prompts)
        assert len(other) == len(in_driver) == 2
        for a, b in zip(in_driver, other):
            assert len(a) == len(b) == 1
            assert_same(a[0], b[0], f"{agent} {'in a worker' if pool else 'in the driver'}: ")
    sample = in_driver[0][0]
    assert sample.episode_end == "done" and sample.reward == 1.0 and len(sample.turn_ends) == 3
    assert sample.routed_experts is not None and sample.sampling_mask is not None


def blocked_and_quick_finish_times(loop, agents, block_s):
    """(when the episode that blocks its loop for ``block_s`` ended, when each of three others ended), in
    seconds from the start, all four run at once."""
    async def timed(prompt, i, start):
        await agents.run(prompt, "g", f"ep{i}")
        return time.monotonic() - start

    async def body():
        try:
            await agents.run(Prompt("1+1="), "g", "warm")  # the worker's process and imports are ready
            start = time.monotonic()
            prompts = [Prompt("2+2=", metadata={"block_s": block_s})] + [Prompt(f"{i}+3=") for i in range(3)]
            return await asyncio.gather(*(timed(p, i, start) for i, p in enumerate(prompts)))
        finally:
            await agents.aclose()

    blocked, *quick = loop.run_until_complete(body())
    return blocked, quick


def test_a_blocking_agent_stalls_no_other_episode_in_a_worker(client, tokenizer, workers, loop):
    params = dataclasses.replace(GREEDY, max_new_tokens=2)
    blocked, quick = blocked_and_quick_finish_times(
        loop, episodes(client, tokenizer, "blocks_its_loop", workers, params), block_s=3.0)
    assert blocked >= 3.0 and max(quick) < blocked - 1.0, (blocked, quick)
    # in the driver's loop, the same agent holds every episode up until it has blocked
    blocked, quick = blocked_and_quick_finish_times(loop, episodes(client, tokenizer, "blocks_its_loop",
                                                                   params=params), block_s=1.0)
    assert min(quick) >= 1.0, (blocked, quick)


def test_failing_agents_in_a_worker_end_as_counted_errors(client, tokenizer, workers, loop):
    cases = {"raises": ("raised", "error: agent raised ValueError: the agent lost its way"),
             "raises_sync": ("raised", "error: agent raised ValueError: the agent lost its way"),
             "hangs": ("timeout", "error: agent ran past the timeout of 1 s"),
             "hangs_sync": ("timeout", "error: agent ran past the timeout of 1 s"),
             "returns_string": ("malformed_result", "error: agent returned 'a good episode'"),
             "returns_a_lock": ("malformed_result", "error: agent returned <unlocked _thread.lock"),
             "silent": ("no_calls", "error: agent made no call to the gateway")}

    async def body():
        agents = {name: episodes(client, tokenizer, name, workers, timeout_s=1.0 if "hangs" in name else 60.0)
                  for name in cases}
        try:
            return agents, dict(zip(agents, await asyncio.gather(*(a.run(Prompt("2+2="), "g", name)
                                                                   for name, a in agents.items()))))
        finally:
            for a in agents.values():
                await a.aclose()

    agents, results = loop.run_until_complete(body())
    for name, (kind, end) in cases.items():
        [sample] = results[name]
        assert agents[name].errors == {kind: 1}, (name, agents[name].errors)
        assert sample.episode_end.startswith(end), (name, sample.episode_end)
        assert sample.finish_reason is FinishReason.ERROR and sample.reward == 0.0


def test_a_worker_that_dies_fails_its_episode_as_worker_lost(client, tokenizer, workers, loop):
    agents = episodes(client, tokenizer, "hangs", workers)

    async def body():
        episode = asyncio.ensure_future(agents.run(Prompt("2+2="), "g", "lost"))
        while not any(workers.in_flight):
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the episode is running in the worker
        ray.kill(workers.actors[0], no_restart=False)
        try:
            return await episode
        finally:
            await agents.aclose()

    [sample] = loop.run_until_complete(body())
    assert agents.errors == {"worker_lost": 1} and sample.episode_end.startswith("error: agent worker 0 died")


@pytest.mark.unit
def test_a_worker_imports_the_agent_by_module_and_name():
    spec, root = agent_spec(load_agent("agent_examples:three_turns"))
    assert spec == "agent_examples:three_turns" and root.endswith("/tests")

    def nested(client, prompt):
        return 1.0

    with pytest.raises(ValueError, match="must be a module-level function of an importable module"):
        agent_spec(nested)
