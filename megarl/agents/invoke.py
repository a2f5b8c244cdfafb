"""One call of an agent function on its episode's gateway session, wherever it runs (in the driver's
event loop, or in a thread of an agent worker, ``megarl/agents/workers.py``).

:func:`run_agent` gives the function a client of the session -- ``openai.AsyncOpenAI`` for an
``async def`` agent, ``openai.OpenAI`` for a plain function (which runs in a daemon thread of its own,
so that blocking calls and CPU-bound tools stall no other episode's loop) -- and returns
``(result, None)`` or ``(None, (error kind, reason))``: kind ``raised`` (the agent raised or was
cancelled) or ``timeout`` (it ran past ``timeout_s``; an ``async`` agent is cancelled, a plain one
is left to finish in its thread, its late result dropped). The result itself is checked by the caller.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading

import openai

from megarl.agents.spec import AgentFn, AgentResult
from megarl.tasks.prompts import Prompt

CANCEL_GRACE_S = 1.0  # how long a timed-out agent may take to honour its cancellation

Failure = tuple[str, str]  # (error kind, reason)


async def run_agent(agent: AgentFn, base_url: str, api_key: str, prompt: Prompt,
                    timeout_s: float) -> tuple[AgentResult, Failure | None]:
    """Run ``agent(client, prompt)`` on the session at ``base_url`` (its credential ``api_key``; no
    retries, ``timeout_s`` per request) for at most ``timeout_s`` (module docstring)."""
    # the gateway speaks plain HTTP: no TLS context is built (it would cost more CPU than a short call)
    if inspect.iscoroutinefunction(agent):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s,
                                    http_client=openai.DefaultAsyncHttpxClient(verify=False))
        try:
            return await _run_async(agent, client, prompt, timeout_s)
        finally:
            await client.close()
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s,
                           http_client=openai.DefaultHttpxClient(verify=False))
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_running_or_notify_cancel()  # a timeout then leaves it to the thread (set_result stays valid)

    def body() -> None:
        try:
            done.set_result(agent(client, prompt))
        except BaseException as e:  # noqa: BLE001 -- the agent's error is the episode's, reported below
            done.set_exception(e)
        finally:
            client.close()

    threading.Thread(target=body, name="megarl-agent", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.wrap_future(done), timeout_s), None
    except TimeoutError:
        return None, ("timeout", f"agent ran past the timeout of {timeout_s:g} s")
    except Exception as e:  # noqa: BLE001 -- a failing agent ends its episode, counted
        return None, ("raised", f"agent raised {type(e).__name__}: {e}")


async def _run_async(agent: AgentFn, client: openai.AsyncOpenAI, prompt: Prompt,
                     timeout_s: float) -> tuple[AgentResult, Failure | None]:
    """An ``async def`` agent as a task of the running loop; a cancelled run cancels the agent."""
    try:
        task = asyncio.ensure_future(agent(client, prompt))
    except Exception as e:  # noqa: BLE001 -- a failing agent function ends the episode, counted
        return None, ("raised", f"agent raised {type(e).__name__}: {e}")
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    finally:
        if not task.done():
            task.cancel()
    if not done:
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)  # an agent that ignores cancellation is left
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its late error is not reported
        return None, ("timeout", f"agent ran past the timeout of {timeout_s:g} s")
    if task.cancelled():
        return None, ("raised", "agent was cancelled")
    error = task.exception()
    if error is not None:
        return None, ("raised", f"agent raised {type(error).__name__}: {error}")
    return task.result(), None
