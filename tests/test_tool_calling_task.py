"""The tool-calling tiny model's text, on CPU: its tokenizer writes an ``add`` call in a few tokens that
SGLang's qwen25 parser reads back, its chat template renders the OpenAI messages of an episode as the
pieces the warm-up trains on (the policy's turns under the loss, the template's and the tool's text not),
and the tool schema the task trains on is the one the OpenAI Agents SDK sends for the example agent."""
import json

import pytest

from megarl.models.tiny_moe import (
    TOOL_CALLING_DEFAULTS,
    TOOL_CHAT_TEMPLATE,
    TinyMoeSpec,
    tool_calling_corpus,
    train_tokenizer,
)
from megarl.tasks import tool_calling
from megarl.tasks.arithmetic import Problem
from megarl.trainer.warmup import chat_episode_batch

pytestmark = pytest.mark.unit

PROBLEM = Problem("23+58=", "81")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(tool_calling_corpus(99), TOOL_CHAT_TEMPLATE, TOOL_CALLING_DEFAULTS["vocab_size"],
                           words=False)


def render_with(tokenizer):
    return lambda messages, generation: tokenizer.apply_chat_template(
        messages, tools=tool_calling.TOOLS, tokenize=False, add_generation_prompt=generation)


def test_the_episode_pieces_are_the_rendered_conversation(tokenizer):
    render = render_with(tokenizer)
    pieces = tool_calling.transcript(render, PROBLEM, use_tool=True)
    assert "".join(text for text, _ in pieces) == render(tool_calling.messages(PROBLEM, True), False)
    policy = [text for text, written in pieces if written]
    assert policy == ['<tool_call>\n{"name": "add", "arguments": {"a": 23, "b": 58}}\n</tool_call><|endoftext|>',
                      "81<|endoftext|>"]
    assert [text for text, written in pieces if not written][1] == "T:<tool_response>\n81\n</tool_response>\nA:"
    assert '{"name": "add", "description": "Add two integers."' in pieces[0][0]  # the tools, in the system turn
    assert [text for text, written in tool_calling.transcript(render, PROBLEM, False) if written] == ["81<|endoftext|>"]


def test_a_template_that_rewrites_history_is_refused(tokenizer):
    def forgetful(messages, generation):  # drops the tool's result once the answer follows
        return render_with(tokenizer)([m for m in messages if m["role"] != "tool" or generation], generation)

    with pytest.raises(ValueError, match="extension of its history"):
        tool_calling.transcript(forgetful, PROBLEM, use_tool=True)


def test_a_call_is_a_few_tokens_and_the_qwen25_parser_reads_it(tokenizer):
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    [call, _] = [text for text, written in tool_calling.transcript(render_with(tokenizer), PROBLEM, True) if written]
    assert len(tokenizer(call, add_special_tokens=False)["input_ids"]) <= 10
    text = call.removesuffix(tokenizer.eos_token)
    parser = FunctionCallParser([Tool.model_validate(t) for t in tool_calling.TOOLS], "qwen25")
    content, [parsed] = parser.parse_non_stream(text)
    assert (content, parsed.name, json.loads(parsed.parameters)) == ("", "add", {"a": 23, "b": 58})
    whole = "".join(text for text, _ in tool_calling.transcript(render_with(tokenizer), PROBLEM, True))
    assert len(tokenizer(whole, add_special_tokens=False)["input_ids"]) < TOOL_CALLING_DEFAULTS[
        "max_position_embeddings"] // 4
    assert len(tokenizer) <= TOOL_CALLING_DEFAULTS["vocab_size"]


def test_the_warmup_trains_on_the_policy_turns_alone(tokenizer):
    batch = chat_episode_batch(tokenizer, [PROBLEM, Problem("3+4=", "7")], [True, False])
    cu = batch.cu_seqlens.tolist()
    trained = [tokenizer.decode(batch.labels[cu[i]:cu[i + 1]][batch.loss_mask[cu[i]:cu[i + 1]] == 1])
               for i in range(2)]
    assert trained == ['<tool_call>\n{"name": "add", "arguments": {"a": 23, "b": 58}}\n</tool_call><|endoftext|>'
                       '81<|endoftext|>', "7<|endoftext|>"]
    first = tokenizer.decode(batch.tokens[:cu[1]].tolist() + [batch.labels[cu[1] - 1].item()])
    assert first == tokenizer.apply_chat_template(tool_calling.messages(PROBLEM, True), tools=tool_calling.TOOLS,
                                                  tokenize=False)


def test_the_tool_schema_is_the_agents_sdks():
    from agents.models.chatcmpl_converter import Converter

    from megarl.agents.examples.agents_sdk_add import add

    assert Converter.tool_to_openai(add) == tool_calling.ADD_TOOL


def test_the_tool_calling_spec_widens_the_context_unless_the_recipe_says_otherwise():
    import dataclasses

    from megarl.config.schema import ArchConfig

    arch = ArchConfig(num_layers=2)  # the rest None: the spec's defaults
    spec = TinyMoeSpec.from_arch(arch, tool_calling=True)
    assert (spec.tool_calling, spec.max_position_embeddings, spec.vocab_size) == (True, 256, 640)
    assert TinyMoeSpec.from_arch(dataclasses.replace(arch, vocab_size=768), tool_calling=True).vocab_size == 768
    assert TinyMoeSpec.from_arch(arch) == TinyMoeSpec(num_layers=2)
