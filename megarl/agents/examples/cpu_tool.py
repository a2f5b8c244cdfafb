"""A tool-heavy stand-in agent, for ``task.agent=megarl.agents.examples.cpu_tool:generate_then_tool`` and
``tools/bench/agents.py``: one short chat call, then a tool that spends ``TOOL_CPU_S`` seconds of this
thread's CPU (``prompt.metadata["tool_cpu_s"]`` overrides it) in Python, holding the GIL as a pure-Python
tool does, and blocking its caller as a synchronous tool call inside an agent does. Reward 1.0.
"""
from __future__ import annotations

import time

TOOL_CPU_S = 0.2
MAX_TOKENS = 4


def spend_cpu(seconds: float) -> int:
    """Compute for ``seconds`` of this thread's CPU time; returns the iterations done."""
    end, n = time.thread_time() + seconds, 0
    while time.thread_time() < end:
        n += sum(range(200))
    return n


async def generate_then_tool(client, prompt) -> float:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt.text}],
                                         max_tokens=MAX_TOKENS)
    spend_cpu(prompt.metadata.get("tool_cpu_s", TOOL_CPU_S))
    return 1.0
