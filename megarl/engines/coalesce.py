"""Concurrent batch requests to one engine, joined into one.

The rollout asks for each prompt group on its own (a task per group), so a step of the demo sends 64
``/generate`` requests of 8 prompts where one of 512 would do, and each request pays SGLang's
per-request HTTP and tokenizer-manager work. :class:`BatchCoalescer` joins the calls made in one turn
of the event loop (the groups a producer starts together) that share their sampling parameters and metadata flags,
sends them as one request and hands every caller its own samples, in its own order.

An engine that rejects the joint request (an HTTP error: a prompt too long for the context, say)
gets each call again on its own, so the error reaches only the call it belongs to; an engine that
cannot be reached fails every call of the request, each of which its caller resubmits.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from megarl.sample import RolloutSample

# (prompts, group_ids, key) -> one sample per prompt, in order; the key is (params, routing, mask). A prompt
# is whatever the sender takes for one sample (the client's: token ids and the routes of their prefix).
Send = Callable[[list, list[str], tuple], Awaitable[list[RolloutSample]]]


@dataclass
class _Call:
    prompts: list
    group_ids: list[str]
    future: asyncio.Future


class BatchCoalescer:
    """Joins the calls of one event-loop turn with equal keys into one ``send``.

    ``send`` is the client's one-request path. ``isolate(error)`` says whether an error of the joint
    request belongs to one of its calls (it is then retried call by call) rather than to all of them.
    """

    def __init__(self, send: Send, isolate: Callable[[BaseException], bool]):
        self._send = send
        self._isolate = isolate
        self._open: dict[tuple, list[_Call]] = {}
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, prompts: list, group_ids: list[str], key: tuple) -> list[RolloutSample]:
        """One sample per prompt, in order, as ``send`` would return them."""
        loop = asyncio.get_running_loop()
        calls = self._open.get(key)
        if calls is None:
            calls = self._open[key] = []
            loop.call_soon(self._close, key)  # runs after the tasks already queued in this turn
        call = _Call(prompts, group_ids, loop.create_future())
        calls.append(call)
        return await call.future

    def _close(self, key: tuple) -> None:
        task = asyncio.get_running_loop().create_task(self._run(key, self._open.pop(key)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: tuple, calls: list[_Call]) -> None:
        try:
            if len(calls) == 1:
                await self._one(key, calls[0])
                return
            try:
                samples = await self._send([p for c in calls for p in c.prompts],
                                           [g for c in calls for g in c.group_ids], key)
            except Exception as e:
                if not self._isolate(e):
                    for call in calls:
                        _settle(call.future, error=e)
                    return
                await asyncio.gather(*(self._one(key, call) for call in calls))
                return
            start = 0
            for call in calls:
                _settle(call.future, result=samples[start:start + len(call.prompts)])
                start += len(call.prompts)
        finally:  # cancelled (the client closes): no caller waits forever
            for call in calls:
                if not call.future.done():
                    call.future.cancel()

    async def _one(self, key: tuple, call: _Call) -> None:
        try:
            _settle(call.future, result=await self._send(call.prompts, call.group_ids, key))
        except Exception as e:
            _settle(call.future, error=e)

    async def aclose(self) -> None:
        """Cancel the requests in flight (their callers get CancelledError)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _settle(future: asyncio.Future, *, result=None, error: BaseException | None = None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
