"""An agent program written with the OpenAI Agents SDK (``openai-agents``), for
``task.agent=megarl.agents.examples.agents_sdk_add:add_with_tool`` (recipes/tiny_moe_tool_calling.yaml):
an ``Agent`` with the function tool ``add(a, b)`` whose model is megarl's gateway, through the episode's
``openai.AsyncOpenAI`` client, run by ``Runner.run`` on the prompt (``a+b=``).

The SDK sends the tool's schema (``megarl.tasks.tool_calling.ADD_TOOL``), reads the model's call from the
gateway's ``tool_calls``, runs ``add`` and sends its result back as a tool message, until the model answers
with text. Reward: 1.0 when that answer is exactly ``prompt.answer``, else 0.0 (also when the model keeps
calling past ``MAX_MODEL_CALLS``). The SDK's tracing is off: nothing leaves the machine.
"""
from __future__ import annotations

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded

set_tracing_disabled(True)

MAX_MODEL_CALLS = 2  # the call and the answer (the recipe's task.max_turns)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def add_with_tool(client, prompt) -> float:
    """One episode (megarl's agent contract): the agent's answer to ``prompt.text``, rewarded."""
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = Agent(name="adder", tools=[add], model=model)
    try:
        result = await Runner.run(agent, prompt.text, max_turns=MAX_MODEL_CALLS)
    except MaxTurnsExceeded:
        return 0.0
    return 1.0 if str(result.final_output).strip() == prompt.answer else 0.0
