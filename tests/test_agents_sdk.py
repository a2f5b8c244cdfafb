"""The OpenAI Agents SDK example agent (``megarl/agents/examples/agents_sdk_add.py``: an ``Agent`` with a
``function_tool``, ``OpenAIChatCompletionsModel`` on the episode's client, ``Runner.run``) runs an episode
through megarl's gateway on the shared tiny SGLang engine (CPU): the SDK's requests, tools included, are
served, and the episode's sample is the engine's tokens (its raw outputs, HF log-probs). The tiny model's
64-token context holds no tool call; the calls themselves are trained end to end in
tests/test_rl_episodes.py (the tool-calling recipe)."""
import numpy as np
import pytest
import torch
from hf_oracle import assert_sample_matches_hf
from test_agent_gateway import Recording

from megarl.agents.gateway import AgentGateway, GatewaySettings
from megarl.agents.rollout import AgentEpisodes
from megarl.agents.spec import load_agent
from megarl.engines.types import GenerationOptions, SamplingParams
from megarl.tasks.prompts import Prompt

AGENT = "megarl.agents.examples.agents_sdk_add:add_with_tool"


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def test_an_agents_sdk_episode_is_the_engines_tokens(client, tokenizer, hf, loop):
    target = Recording(client)
    gateway = AgentGateway(target, tokenizer, GenerationOptions(SamplingParams(max_new_tokens=4, top_k=5)),
                           GatewaySettings(max_turns=2, max_response_tokens=40, tool_call_parser="qwen25"))
    agents = AgentEpisodes(gateway, load_agent(AGENT), timeout_s=60.0)

    async def episode():
        try:
            return await agents.run(Prompt("3+4=", answer="7"), "g", "ep")
        finally:
            await agents.aclose()

    [sample] = loop.run_until_complete(episode())
    assert not agents.errors and sample.episode_end == "done"
    [(fed, raw)] = target.calls  # the model wrote no call: the SDK's run ended with its text
    assert fed == raw.prompt_ids == sample.prompt_ids == tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=False,
                                      add_generation_prompt=True), add_special_tokens=False)
    assert sample.response_ids == raw.response_ids and (sample.loss_mask == 1).all()
    np.testing.assert_array_equal(sample.rollout_logprobs, raw.rollout_logprobs)
    assert sample.tool_calls == {}
    answer = tokenizer.decode(raw.response_ids, skip_special_tokens=True).strip()
    assert sample.reward == (1.0 if answer == "7" else 0.0)  # the agent's reward: its final output, exact
    assert_sample_matches_hf(sample, hf, 1e-4)
