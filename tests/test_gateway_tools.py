"""OpenAI function calling through the agent gateway, with the plain ``openai`` client against the shared
tiny SGLang engine (CPU): ``tool_choice="required"`` constrains generation (SGLang's structural tag for
the model's qwen25 format) and comes back as parsed ``tool_calls``, the trajectory holds the engine's
generated tokens (log-probs and routing checked against HF on the same weights), a call cut short is
returned as text and counted, ``stream=True`` gives the answer and tokens of the same request unstreamed,
and fields the gateway does not implement are refused by name.

The random tiny model writes whitespace inside JSON wherever a grammar lets it, past its 64-token
context; the tool tests load into the engine a copy (:func:`preferring_checkpoint`) whose every answer
prefers, in order, end-of-sequence, anything, then whitespace, so that a constrained call is the
shortest one. The engine gets the tiny weights back after each such test."""
import json
import shutil

import numpy as np
import openai
import pytest
import torch
from hf_oracle import assert_sample_matches_hf

from megarl.agents.gateway import AgentGateway, GatewaySettings
from megarl.agents.parsers import tool_call_parser
from megarl.engines.types import GenerationOptions, SamplingParams
from megarl.models.hf_config import read_hf_config

PARSER = "qwen25"
CALL_TEXT = '<tool_call>\n{"name":"f", "arguments":{}}\n</tool_call>'  # SGLang's qwen25 tag, no whitespace
TOOLS = [{"type": "function", "function": {"name": "f", "description": "do it", "strict": True,
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
SAMPLING = SamplingParams(max_new_tokens=60, top_k=5)
GREEDY = SamplingParams(max_new_tokens=60, temperature=0.0)
LOGPROB_TOLERANCE = 1e-4


def preferring_checkpoint(src, dst, tokenizer):
    """A copy of ``src`` at ``dst`` whose answers do not depend on the context: attention and experts
    write nothing (the routers still route), the final norm keeps one hidden unit that every embedding
    sets to 10, and the head scores end-of-sequence +2, whitespace -2, any other token 0."""
    from safetensors.torch import load_file, save_file

    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    weights = load_file(dst / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
    weights["model.embed_tokens.weight"][:, 0] = 10.0
    weights["model.norm.weight"].zero_()
    weights["model.norm.weight"][0] = 1.0
    head = torch.zeros_like(weights["lm_head.weight"])
    head[tokenizer.eos_token_id, 0] = 2.0
    for token, i in tokenizer.get_vocab().items():
        if tokenizer.convert_tokens_to_string([token]).isspace():
            head[i, 0] = -2.0
    weights["lm_head.weight"] = head
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def preferring(tiny_checkpoint, tokenizer, tmp_path_factory):
    from pathlib import Path

    return preferring_checkpoint(Path(tiny_checkpoint), tmp_path_factory.mktemp("preferring"), tokenizer)


@pytest.fixture
def tool_model(client, tiny_checkpoint, preferring, loop):
    """The engine serves :func:`preferring_checkpoint` during the test; returns its HF model."""
    from transformers import AutoModelForCausalLM

    loop.run_until_complete(client.update_weights_from_disk(preferring, version=1))
    yield AutoModelForCausalLM.from_pretrained(preferring, dtype=torch.float32).eval()
    loop.run_until_complete(client.update_weights_from_disk(tiny_checkpoint, version=0))


def call(loop, gateway_args, requests):
    """Send ``requests`` (kwargs of ``chat.completions.create``) in one session of a new gateway;
    returns (the gateway, the session, the responses)."""
    async def body():
        policy, tokenizer, params, options = gateway_args
        settings = {k: v for k, v in options.items() if k != "sampling_mask"}
        generation = GenerationOptions(params, sampling_mask=options.get("sampling_mask", True))
        async with AgentGateway(policy, tokenizer, generation, GatewaySettings(**settings)) as gateway:
            session = gateway.open_session("g", "e")
            async with openai.AsyncOpenAI(base_url=gateway.base_url(session.id), api_key=session.key,
                                          max_retries=0) as agent:
                answers = []
                for request in requests:
                    answer = await agent.chat.completions.create(model="m", **request)
                    answers.append([chunk async for chunk in answer] if request.get("stream") else answer)
            return gateway, session, answers

    return loop.run_until_complete(body())


@pytest.mark.unit
def test_the_tiny_model_family_reads_qwen_tool_calls(tiny_checkpoint):
    assert tool_call_parser(None, read_hf_config(tiny_checkpoint).model_type) == PARSER


def test_a_required_tool_call_is_parsed_and_its_tokens_trained(client, tokenizer, tool_model, loop):
    messages = [{"role": "user", "content": "1"}]
    gateway, session, [answer] = call(loop, (client, tokenizer, SAMPLING, dict(max_turns=2, tool_call_parser=PARSER)),
                                      [dict(messages=messages, tools=TOOLS, tool_choice="required", logprobs=True)])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [tool_call] = choice.message.tool_calls
    assert tool_call.id.startswith("call_") and tool_call.type == "function"
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("f", {})
    [segment] = session.trajectory.segments
    [raw] = [c.sample for c in segment.calls]
    [sample] = session.trajectory.samples(group_id="g", episode_id="e", routing=True, sampling_mask=True)
    # what was trained is what the engine generated: the call's text, then end-of-sequence
    assert sample.response_ids == raw.response_ids and (sample.loss_mask == 1).all()
    assert tokenizer.decode(raw.response_ids) == CALL_TEXT + tokenizer.eos_token
    assert [t.logprob for t in choice.logprobs.content] == raw.rollout_logprobs.tolist()
    assert "".join(t.token for t in choice.logprobs.content) == CALL_TEXT + tokenizer.eos_token
    assert_sample_matches_hf(sample, tool_model, LOGPROB_TOLERANCE)  # the grammar's mask is in the sampling mask
    assert gateway.tool_call_counts == {"parsed": 1}
    # the history an OpenAI agent sends back (its call, no content, the tool's result) renders as the
    # generated text, so that the next call would extend this segment
    history = messages + [answer.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": tool_call.id, "content": "3"}]
    use = gateway._tool_use({"tools": TOOLS})
    assert session.trajectory.extendable("", gateway._render({"messages": history}, use, session)) is segment


def test_a_call_cut_by_the_budget_is_text_and_counted(client, tokenizer, tool_model, loop):
    gateway, session, [answer] = call(
        loop, (client, tokenizer, SAMPLING, dict(max_turns=2, tool_call_parser=PARSER)),
        [dict(messages=[{"role": "user", "content": "1"}], tools=TOOLS, tool_choice={"type": "function",
                                                                                     "function": {"name": "f"}},
              max_tokens=12)])
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content == CALL_TEXT[:len(choice.message.content)] and len(choice.message.content) >= 12
    assert gateway.tool_call_counts == {"unparsable": 1}


def test_auto_tool_choice_without_a_call_is_plain_text(client, tokenizer, tool_model, loop):
    gateway, _, [answer] = call(loop, (client, tokenizer, SAMPLING, dict(max_turns=2, tool_call_parser=PARSER)),
                                [dict(messages=[{"role": "user", "content": "1"}], tools=TOOLS)])
    # unconstrained, this model ends at once: no call, nothing counted
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content == "" and not gateway.tool_call_counts


@pytest.mark.parametrize("tools", [False, True])
def test_a_streamed_answer_is_the_unstreamed_one(client, tokenizer, preferring, tiny_checkpoint, tools, loop):
    """Greedy, on the tiny model (plain text) and on the preferring one (a required call)."""
    if tools:
        loop.run_until_complete(client.update_weights_from_disk(preferring, version=1))
    request = dict(messages=[{"role": "user", "content": "1"}], max_tokens=6, logprobs=True)
    if tools:
        request = dict(request, tools=TOOLS, tool_choice="required", max_tokens=None)
    try:
        args = (client, tokenizer, GREEDY, dict(max_turns=2, tool_call_parser=PARSER, sampling_mask=False))
        _, whole, [answer] = call(loop, args, [request])
        _, streamed, [chunks] = call(loop, args, [dict(request, stream=True, stream_options={"include_usage": True})])
    finally:
        if tools:
            loop.run_until_complete(client.update_weights_from_disk(tiny_checkpoint, version=0))
    message = answer.choices[0].message
    assert bool(message.content) != tools  # text from the tiny model, a call alone from the preferring one
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == (message.content or "")
    calls = [tc for d in deltas for tc in d.delta.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    assert bool(calls) == tools and [d.finish_reason for d in deltas if d.finish_reason] == \
        [answer.choices[0].finish_reason]
    # the same tokens; their log-probs within float noise (the second prefill reuses the engine's prefix cache)
    assert [t.token for d in deltas if d.logprobs for t in d.logprobs.content] == \
        [t.token for t in answer.choices[0].logprobs.content]
    np.testing.assert_allclose([t.logprob for d in deltas if d.logprobs for t in d.logprobs.content],
                               [t.logprob for t in answer.choices[0].logprobs.content], atol=LOGPROB_TOLERANCE)
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    [a], [b] = ([c.sample for c in s.trajectory.segments[0].calls] for s in (whole, streamed))
    assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
    np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=LOGPROB_TOLERANCE)


def test_what_the_gateway_does_not_implement_is_refused_by_name(client, tokenizer, loop):
    async def body():
        gateway = AgentGateway(client, tokenizer, GenerationOptions(SAMPLING), GatewaySettings(max_turns=2))
        async with gateway:
            session = gateway.open_session()
            async with openai.AsyncOpenAI(base_url=gateway.base_url(session.id), api_key=session.key,
                                          max_retries=0) as agent:
                messages = [{"role": "user", "content": "1"}]
                refused = {"seed": dict(seed=3), "top_logprobs": dict(logprobs=True, top_logprobs=2),
                           "n": dict(n=2), "tools": dict(tools=TOOLS), "tool_choice": dict(tool_choice="required")}
                errors = {}
                for field, extra in refused.items():
                    with pytest.raises(openai.BadRequestError) as e:
                        await agent.chat.completions.create(model="m", messages=messages, **extra)
                    errors[field] = (e.value.body["param"], e.value.body["message"])
                with pytest.raises(openai.BadRequestError, match="does not implement 'suffix'"):
                    await agent.completions.create(model="m", prompt="1", suffix="2")
                return errors, gateway.sessions

    errors, sessions = loop.run_until_complete(body())
    assert {field: param for field, (param, _) in errors.items()} == {field: field for field in errors}
    assert "does not implement 'seed'" in errors["seed"][1]
    assert "sampled token only" in errors["top_logprobs"][1] and "make n calls" in errors["n"][1]
    assert "rollout.tool_call_parser" in errors["tools"][1] and "needs 'tools'" in errors["tool_choice"][1]
    assert all(not s.trajectory.segments for s in sessions.values())  # nothing reached the engine
