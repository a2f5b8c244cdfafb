"""The OpenAI-compatible agent gateway against one real SGLang server (CPU here), driven by the real
``openai`` client: a three-turn agent's trajectory is exactly the engine's tokens (checked against
the raw engine outputs and an HF forward pass over the whole trajectory), failing agents end as
counted error episodes, budgets end episodes with their reason, a rewritten history opens a second
sample, two roles give two samples with their own rewards, and an aborted call is continued into
one turn."""
import dataclasses

import numpy as np
import openai
import pytest
import torch
from hf_oracle import assert_sample_matches_hf

from megarl.agents.gateway import AgentGateway, GatewaySettings
from megarl.agents.rollout import AgentEpisodes
from megarl.agents.spec import load_agent
from megarl.engines.types import GenerationOptions, SamplingParams
from megarl.sample import FinishReason
from megarl.tasks.prompts import Prompt
from megarl.tasks.rewards import RewardScorer

LOGPROB_TOLERANCE = 1e-4
PARAMS = SamplingParams(max_new_tokens=4, top_k=5)


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


class Recording:
    """An ``Engines`` that records each request's prompt ids and the engine's raw sample; with
    ``abort_first`` its first request stops after 2 tokens and comes back aborted (as a pause with
    abort would leave it)."""

    def __init__(self, target, abort_first=False):
        self.target, self.model, self.abort_first = target, target.model, abort_first
        self.calls = []

    async def generate_batch(self, prompts, params, **kwargs):
        if self.abort_first and not self.calls:
            [sample] = await self.target.generate_batch(prompts, dataclasses.replace(params, max_new_tokens=2),
                                                        **kwargs)
            samples = [dataclasses.replace(sample, finish_reason=FinishReason.ABORTED)]
        else:
            samples = await self.target.generate_batch(prompts, params, **kwargs)
        self.calls += [(list(p), s) for p, s in zip(prompts, samples)]
        return samples


def episodes(target, tokenizer, agent, timeout_s=60.0, reward_fn=None, roles=None, **settings):
    """``agent``'s episodes through a gateway of ``GatewaySettings(**settings)`` (3 turns, 40 tokens unless
    given), scored by ``reward_fn`` when it is given."""
    settings = GatewaySettings(**{"max_turns": 3, "max_response_tokens": 40, **settings})
    gateway = AgentGateway(target, tokenizer, GenerationOptions(PARAMS), settings, roles)
    return AgentEpisodes(gateway, load_agent(f"agent_examples:{agent}"), timeout_s=timeout_s,
                         scorer=RewardScorer(reward_fn) if reward_fn is not None else None)


def run(loop, agents, prompt, episode_id="ep"):
    async def body():
        try:
            return await agents.run(prompt, "g", episode_id)
        finally:
            await agents.aclose()

    return loop.run_until_complete(body())


def test_three_turn_agent_records_the_engine_tokens(client, tokenizer, hf, loop):
    target = Recording(client)
    agents = episodes(target, tokenizer, "three_turns")
    sent = []
    [sample] = run(loop, agents, Prompt("3+4=", metadata={"log": sent}))
    assert (sample.role, sample.episode_end, sample.reward, sample.group_id, sample.episode_id) == ("", "done", 1.0,
                                                                                                     "g", "ep")
    assert len(target.calls) == 3 and len(sent) == 3
    ids = sample.prompt_ids + sample.response_ids
    p, start, ends = len(sample.prompt_ids), 0, []
    for n, (fed, raw) in enumerate(target.calls):
        # the engine was fed the trajectory so far, token for token, and its tokens are the trajectory's
        assert fed == raw.prompt_ids == ids[:len(fed)]
        gen = slice(len(fed) - p, len(fed) - p + len(raw.response_ids))
        assert sample.response_ids[gen] == raw.response_ids and (sample.loss_mask[gen] == 1).all()
        np.testing.assert_array_equal(sample.rollout_logprobs[gen], raw.rollout_logprobs)
        np.testing.assert_array_equal(sample.model_version[gen], raw.model_version)
        between = sample.response_ids[start:gen.start]
        assert (sample.loss_mask[start:gen.start] == 0).all()
        if n == 0:
            assert fed == tokenizer.encode(tokenizer.apply_chat_template(sent[0], tokenize=False,
                                                                         add_generation_prompt=True),
                                           add_special_tokens=False)
        else:
            # only the text after the previous call's prompt + its completion was tokenized
            previous = tokenizer.apply_chat_template(sent[n - 1], tokenize=False, add_generation_prompt=True)
            content = sent[n][-2]["content"]
            assert content == tokenizer.decode(target.calls[n - 1][1].response_ids, skip_special_tokens=True)
            rendered = tokenizer.apply_chat_template(sent[n], tokenize=False, add_generation_prompt=True)
            ended = target.calls[n - 1][1].finish_reason is FinishReason.STOP  # by EOS: no stop strings here
            suffix = rendered[len(previous) + len(content) + (len(tokenizer.eos_token) if ended else 0):]
            assert between == tokenizer.encode(suffix, add_special_tokens=False) and between
        start = gen.stop
        ends.append(gen.stop)
    assert start == len(sample.response_ids) and sample.turn_ends == tuple(ends)
    np.testing.assert_array_equal(sample.routed_experts, target.calls[-1][1].routed_experts)
    assert sample.finish_reason is target.calls[-1][1].finish_reason
    worst = assert_sample_matches_hf(sample, hf, LOGPROB_TOLERANCE)
    print(f"\n[measured] three turns: {len(sample.prompt_ids)} prompt + {len(sample.response_ids)} response tokens "
          f"({int(sample.loss_mask.sum())} generated), max |log-prob - HF| {worst:.1e}")


def test_gateway_http_contract(client, tokenizer, loop):
    async def body():
        async with AgentGateway(client, tokenizer, GenerationOptions(PARAMS), GatewaySettings(max_turns=3)) as gateway:
            session, other = gateway.open_session("g", "e"), gateway.open_session("g", "f")
            agent = openai.AsyncOpenAI(base_url=gateway.base_url(session.id), api_key=session.key, max_retries=0)
            lost = openai.AsyncOpenAI(base_url=gateway.base_url("no-such-session"), api_key="x", max_retries=0)
            try:
                with pytest.raises(openai.NotFoundError, match="unknown session 'no-such-session'"):
                    await lost.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])
                await refused_without_the_sessions_key(gateway.base_url(session.id), other.key)
                with pytest.raises(openai.BadRequestError, match="'messages' must be a non-empty list"):
                    await agent.chat.completions.create(model="m", messages=[])
                with pytest.raises(openai.BadRequestError, match="'max_tokens' must be an integer >= 1"):
                    await agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}],
                                                        max_tokens=0)
                first = await agent.completions.create(model="m", prompt="1+2=", max_tokens=3)
                text = first.choices[0].text
                # continuing the text (an end-of-sequence token written out) reuses the recorded tokens
                special = tokenizer.eos_token if first.choices[0].finish_reason == "stop" else ""
                second = await agent.completions.create(model="m", prompt=f"1+2={text}{special}\n", max_tokens=3)
                gateway.close_session(session.id)
                with pytest.raises(openai.NotFoundError):  # a closed session is gone
                    await agent.completions.create(model="m", prompt="1", max_tokens=1)
            finally:
                await agent.close()
                await lost.close()
            return session, first, second

    session, first, second = loop.run_until_complete(body())
    [segment] = session.trajectory.segments
    a, b = (c.sample for c in segment.calls)
    assert b.prompt_ids == a.prompt_ids + a.response_ids + tokenizer.encode("\n", add_special_tokens=False)
    assert first.usage.completion_tokens == len(a.response_ids) and second.usage.prompt_tokens == len(b.prompt_ids)
    assert first.choices[0].text == tokenizer.decode(a.response_ids, skip_special_tokens=True)


async def refused_without_the_sessions_key(url, other_key):
    """A call without a credential, or with another session's, is a 401 naming what is wrong; nothing is
    generated."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/completions", json={"model": "m", "prompt": "1"}) as response:
            assert response.status == 401
            assert "carries no credential for session" in (await response.json())["error"]["message"]
    async with openai.AsyncOpenAI(base_url=url, api_key=other_key, max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError, match="is not the credential of session") as e:
            await stranger.completions.create(model="m", prompt="1", max_tokens=1)
    assert e.value.body["code"] == "invalid_api_key"


def test_failing_agents_end_as_counted_errors(client, tokenizer, loop):
    async def body():
        agents = {name: episodes(client, tokenizer, name, timeout_s=1.0 if name == "hangs" else 60.0)
                  for name in ("raises", "hangs", "returns_string", "wrong_roles", "silent")}
        try:
            return agents, {name: await a.run(Prompt("2+2="), "g", name) for name, a in agents.items()}
        finally:
            for a in agents.values():
                await a.aclose()

    agents, results = loop.run_until_complete(body())
    expected = {"raises": ("raised", "error: agent raised ValueError: the agent lost its way"),
                "hangs": ("timeout", "error: agent ran past the timeout of 1 s"),
                "returns_string": ("malformed_result", "error: agent returned 'a good episode'"),
                "wrong_roles": ("malformed_result", "error: agent returned rewards for roles ['critic']"),
                "silent": ("no_calls", "error: agent made no call to the gateway")}
    for name, (kind, end) in expected.items():
        [sample] = results[name]
        assert agents[name].errors == {kind: 1}, (name, agents[name].errors)
        assert sample.episode_end.startswith(end), (name, sample.episode_end)
        assert sample.finish_reason is FinishReason.ERROR and sample.reward == 0.0
        assert sample.response_ids == [] if name in ("hangs", "silent") else len(sample.response_ids) >= 1


def test_budgets_end_the_episode_with_their_reason(client, tokenizer, loop):
    scored = []

    async def reward(inp):
        scored.append(inp)
        return 0.25

    target = Recording(client)
    agents = episodes(target, tokenizer, "three_turns", max_turns=2, reward_fn=reward)
    [sample] = run(loop, agents, Prompt("5+1="))
    assert len(target.calls) == 2 and len(sample.turn_ends) == 2
    assert sample.episode_end == "max_turns" and sample.finish_reason is FinishReason.LENGTH
    assert agents.budget_ends == {"max_turns": 1} and not agents.errors
    # the agent raised on the refused call, so the reward function scored the final completion
    [inp] = scored
    assert sample.reward == 0.25 and inp.sample is sample
    assert inp.response_text == tokenizer.decode(target.calls[-1][1].response_ids, skip_special_tokens=True)

    target = Recording(client)
    agents = episodes(target, tokenizer, "three_turns", max_response_tokens=PARAMS.max_new_tokens + 1)
    [sample] = run(loop, agents, Prompt("5+1="))
    assert len(target.calls) == 1 and sample.episode_end == "max_tokens" and sample.reward is None
    assert agents.budget_ends == {"max_tokens": 1}


def test_a_rewritten_history_opens_a_second_sample(client, tokenizer, loop):
    target = Recording(client)
    agents = episodes(target, tokenizer, "rewrites_history")
    sent = []
    first, second = run(loop, agents, Prompt("7+1=", metadata={"log": sent}))
    assert [(s.reward, s.episode_end, s.role) for s in (first, second)] == [(0.5, "done", ""), (0.5, "done", "")]
    for sample, (fed, raw) in zip((first, second), target.calls):
        assert sample.prompt_ids == fed and sample.response_ids == raw.response_ids
    # the second conversation is tokenized from its own text (its history is not the engine's tokens)
    assert second.prompt_ids == tokenizer.encode(
        tokenizer.apply_chat_template(sent[0], tokenize=False, add_generation_prompt=True), add_special_tokens=False)


def test_two_roles_give_two_samples_with_their_rewards(client, tokenizer, hf, loop):
    target = Recording(client)
    agents = episodes(target, tokenizer, "solver_and_verifier", roles={"solver": None, "verifier": target})
    samples = run(loop, agents, Prompt("4+4="))
    assert [(s.role, s.reward, s.episode_end) for s in samples] == [("solver", 1.0, "done"),
                                                                   ("verifier", -0.5, "done")]
    for sample, (fed, raw) in zip(samples, target.calls):
        assert sample.prompt_ids == fed and sample.response_ids == raw.response_ids
        assert_sample_matches_hf(sample, hf, LOGPROB_TOLERANCE)

    async def unknown_role():
        gateway = AgentGateway(client, tokenizer, GenerationOptions(PARAMS), GatewaySettings(max_turns=1),
                               {"solver": client})
        async with gateway:
            session = gateway.open_session()
            async with openai.AsyncOpenAI(base_url=gateway.base_url(session.id), api_key=session.key,
                                          max_retries=0) as agent:
                with pytest.raises(openai.NotFoundError, match="model 'critic' is not a role"):
                    await agent.chat.completions.create(model="critic", messages=[{"role": "user", "content": "1"}])

    loop.run_until_complete(unknown_role())


def test_a_frozen_role_is_served_by_its_engine_and_not_trained(client, tokenizer, loop):
    """A role a frozen model serves: its calls go to that model's engine without routing or masks, the
    episode's samples are the trained roles' alone, and a reward for the frozen role is malformed."""
    policy, frozen = Recording(client), Recording(client)
    roles = {"solver": None, "verifier": frozen}
    agents = episodes(policy, tokenizer, "solver_and_frozen_verifier", roles=roles, frozen_roles={"verifier"})
    [sample] = run(loop, agents, Prompt("4+4="))
    assert (sample.role, sample.reward, sample.episode_end) == ("solver", 1.0, "done")
    [(fed, raw)] = policy.calls
    assert sample.prompt_ids == fed and sample.response_ids == raw.response_ids
    assert raw.routed_experts is not None and raw.sampling_mask is not None
    [(verifier_fed, verdict)] = frozen.calls
    assert verdict.routed_experts is None and verdict.sampling_mask is None  # nothing trains on them
    assert tokenizer.decode(raw.response_ids, skip_special_tokens=True) in tokenizer.decode(verifier_fed)

    agents = episodes(policy, tokenizer, "solver_and_verifier", roles=roles, frozen_roles={"verifier"})
    [bad] = run(loop, agents, Prompt("4+4="))
    assert bad.finish_reason is FinishReason.ERROR and bad.role == "solver" and bad.reward == 0.0
    assert "the frozen roles ['verifier'] get none" in bad.episode_end
    assert agents.errors == {"malformed_result": 1}
    with pytest.raises(ValueError, match=r"frozen_roles \['critic'\] must be roles of \['solver', 'verifier'\]"):
        episodes(policy, tokenizer, "solver_and_verifier", roles=roles, frozen_roles={"critic"})


def test_role_engines_send_each_roles_calls_to_its_engines(client, tokenizer, loop):
    """``task.role_engines`` through the driver's ``episode_runner``: the verifier's calls go to
    engine 1 only, the solver (not placed) is served by the least-loaded of all."""
    from megarl.config import load_config
    from megarl.engines.pool import EnginePool
    from megarl.pipeline.startup.rollout import episode_runner

    cfg = load_config(["recipe=tiny_moe_cpu", "task.agent=agent_examples:solver_and_verifier",
                       "task.roles=[solver,verifier]", "rollout.num_engines=2",
                       "task.role_engines=[{role:verifier,engines:[1]}]"])
    engines = [Recording(client), Recording(client)]
    agents = episode_runner(cfg, EnginePool(engines), tokenizer, PARAMS)
    samples = [s for i in range(2) for s in run(loop, agents, Prompt(f"{i}+4="), episode_id=f"ep{i}")]
    assert [(s.role, s.episode_end) for s in samples] == [("solver", "done"), ("verifier", "done")] * 2
    solver_prompts = [s.prompt_ids for s in samples if s.role == "solver"]
    verifier_prompts = [s.prompt_ids for s in samples if s.role == "verifier"]
    assert [fed for fed, _ in engines[1].calls] == verifier_prompts  # both verifier calls, only they
    assert [fed for fed, _ in engines[0].calls] == solver_prompts  # idle engines: ties go to engine 0


def test_an_aborted_call_is_continued_into_one_turn(client, tokenizer, hf, loop):
    target = Recording(client, abort_first=True)
    agents = episodes(target, tokenizer, "three_turns", partial_rollout="abort_resubmit")
    [sample] = run(loop, agents, Prompt("6+2="))
    (fed0, cut), (fed1, rest) = target.calls[:2]
    assert cut.finish_reason is FinishReason.ABORTED and fed1 == fed0 + cut.response_ids
    assert len(target.calls) == 4 and len(sample.turn_ends) == 3
    assert sample.response_ids[:sample.turn_ends[0]] == cut.response_ids + rest.response_ids
    assert len(cut.response_ids + rest.response_ids) <= PARAMS.max_new_tokens
    assert_sample_matches_hf(sample, hf, LOGPROB_TOLERANCE)
