"""Requests in flight at a pause, whatever the machine's load: tests that sync or abort across
running requests start them, then await :func:`until_decoding` before the sync (a fixed sleep was
too short on a loaded machine: the requests were not running yet, or had already ended)."""
import asyncio
import time

import httpx


async def until_decoding(url: str, api_key: str | None = None, timeout_s: float = 120.0) -> int:
    """Poll SGLang's ``/v1/loads`` until its schedulers run at least one request; returns how many."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as http:
        while True:
            response = await http.get("/v1/loads", params={"include": "core"})
            response.raise_for_status()
            running = sum(load["num_running_reqs"] for load in response.json()["loads"])
            if running:
                return running
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: no request running within {timeout_s:.0f} s")
            await asyncio.sleep(0.005)
