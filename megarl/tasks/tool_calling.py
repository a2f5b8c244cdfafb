"""The tool-calling demo task: addition (``a+b=``, the arithmetic task's problems) with an ``add(a, b)``
function tool, in OpenAI's function-calling format as a chat template renders it.

An episode answers at once (the assistant's ``81``) or calls the tool first: an assistant turn holding the
call (``<tool_call>\\n{"name": "add", "arguments": {"a": 23, "b": 58}}\\n</tool_call>``, the Qwen format
that SGLang's ``qwen25`` parser reads), the tool's message (``81``), then the answer. :func:`transcript`
cuts an episode's rendered text into what the policy writes and what the template and the tool write, as
an agent's episode through megarl's gateway is recorded (``megarl/agents/gateway.py``).
"""
from __future__ import annotations

import json
from collections.abc import Callable

from megarl.tasks.arithmetic import Problem

# The tool as an OpenAI chat request offers it: the schema the OpenAI Agents SDK writes for
# ``@function_tool def add(a: int, b: int) -> int`` with the docstring "Add two integers."
# (megarl/agents/examples/agents_sdk_add.py); the tokenizer of the tool-calling tiny model is trained on it.
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}},
                   "required": ["a", "b"], "title": "add_args", "type": "object", "additionalProperties": False}}}
TOOLS = [ADD_TOOL]

Render = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> the chat template's text


def operands(problem: Problem) -> tuple[int, int]:
    """``(a, b)`` of a problem ``a+b=``."""
    a, b = problem.prompt.removesuffix("=").split("+")
    return int(a), int(b)


def messages(problem: Problem, use_tool: bool) -> list[dict]:
    """The episode as OpenAI chat messages: the user's problem, then the answer, or the call, the tool's
    result and the answer."""
    user = {"role": "user", "content": problem.prompt}
    answer = {"role": "assistant", "content": problem.answer}
    if not use_tool:
        return [user, answer]
    a, b = operands(problem)
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
    return [user, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(a + b)}, answer]


def transcript(render: Render, problem: Problem, use_tool: bool) -> list[tuple[str, bool]]:
    """The episode's rendered text as (text, written by the policy) pieces: the prompt (the generation
    prompt after the user's turn), then per assistant turn what the policy writes (its end-of-sequence
    token included) and, between turns, the template's and the tool's text up to the next generation
    prompt. ValueError when the template does not render each turn as an extension of the one before."""
    conversation = messages(problem, use_tool)
    pieces, done = [], ""
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt = render(conversation[:i], True)
        written = render(conversation[:i + 1], False)
        if not (prompt.startswith(done) and written.startswith(prompt)):
            raise ValueError(f"the chat template does not render {conversation[:i + 1]} as an extension of its "
                             "history: the turns of an episode cannot be cut apart")
        pieces += [(prompt[len(done):], False), (written[len(prompt):], True)]
        done = written
    return pieces
