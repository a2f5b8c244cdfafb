"""Requests in flight at a pause, whatever the machine's load: tests that sync or abort across
running requests start them with :func:`start_decoding` (or their own condition on
:func:`engine_loads`) before the pause: a fixed sleep was too short on a loaded machine (the requests
were not running yet) or too long (they had already ended)."""
import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

import httpx


async def engine_loads(url: str, api_key: str | None = None, timeout_s: float = 120.0,
                       interval_s: float = 0.005) -> AsyncIterator[tuple[int, int]]:
    """(running, waiting) requests of the engine's schedulers (SGLang's ``/v1/loads``), every
    ``interval_s``; raises TimeoutError once ``timeout_s`` have passed without the caller stopping."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as http:
        while time.monotonic() < deadline:
            response = await http.get("/v1/loads", params={"include": "core"})
            response.raise_for_status()
            loads = response.json()["loads"]
            yield sum(load["num_running_reqs"] for load in loads), sum(load["num_waiting_reqs"] for load in loads)
            await asyncio.sleep(interval_s)
    raise TimeoutError(f"{url}: the expected load did not come within {timeout_s:.0f} s")


class RequestsEnded(RuntimeError):
    """Every request started for a pause ended before the engine was seen running one."""


async def until_decoding(url: str, api_key: str | None = None, requests: Sequence[asyncio.Future] = (),
                         timeout_s: float = 120.0) -> int:
    """Wait until the engine's schedulers run at least one request; returns how many. Raises
    :class:`RequestsEnded` as soon as all of ``requests`` (the futures of the requests started for
    it) are done without one seen running: a loaded machine can delay a poll past a whole batch."""
    async for running, _ in engine_loads(url, api_key, timeout_s):
        if running:
            return running
        if requests and all(future.done() for future in requests):
            raise RequestsEnded(f"{url}: all {len(requests)} requests ended before one was seen running")


async def start_decoding(start: Callable[[], list[asyncio.Future]], url: str, api_key: str | None = None,
                         attempts: int = 3) -> list[asyncio.Future]:
    """``start()``'s requests, once the engine runs one of them; sent again by a new ``start()`` (at
    most ``attempts`` times in all) when they all ended before that was seen."""
    for attempt in range(1, attempts + 1):
        requests = start()
        try:
            await until_decoding(url, api_key, requests)
            return requests
        except RequestsEnded:
            if attempt == attempts:
                raise
