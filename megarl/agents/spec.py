"""An agent function named in the config: ``task.agent = "package.module:function"`` (the contract:
``megarl/agents/rollout.py``). Imports neither openai nor the gateway, so that checking a config
does not load the agent runtime."""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openai

    from megarl.tasks.prompts import Prompt

AgentResult = float | dict[str, float] | None
# ``async def agent(openai.AsyncOpenAI, Prompt)`` or ``def agent(openai.OpenAI, Prompt)``
AgentFn = Callable[["openai.AsyncOpenAI", "Prompt"], Awaitable[AgentResult]] \
    | Callable[["openai.OpenAI", "Prompt"], AgentResult]


def load_agent(spec: str) -> AgentFn:
    """The function (``async def`` or plain) named by ``"package.module:function"``; ValueError naming what
    is wrong."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"task.agent: must be 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"task.agent: {spec!r}: cannot import {module_name!r}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"task.agent: {spec!r}: module {module_name!r} has no {name!r}")
    if not inspect.isfunction(fn) or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise ValueError(f"task.agent: {spec!r} must be a function of (client, prompt), 'async def' or plain; "
                         f"got {type(fn).__name__}")
    return fn
