"""An engine's control call on a pooled connection the server is closing: the request lands on the
connection as the server's keep-alive timer fires, is never read, and the call fails with a ReadError
though the server is healthy. The client drops connections idle for ``IDLE_CONNECTION_S``, below the
server's keep-alive timeout, so that it never sends on one the server may be closing."""
import asyncio
import importlib.util
import re
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from megarl.engines import client as engine_client
from megarl.engines.client import SGLangClient
from megarl.engines.types import EngineUnreachable, ServedModel
from megarl.parallel import free_port

MODEL = ServedModel(vocab_size=16, num_layers=2, topk=2, num_experts=4, context_length=64)
KEEP_ALIVE_S = 1.0  # the stand-in server's keep-alive timeout (SGLang's uvicorn: SGLANG_TIMEOUT_KEEP_ALIVE)
IDLE_S = 1.5  # how long the client's connection waits between the two calls
BUSY_S = 2.0  # the server's long loop turn, from just before the keep-alive timeout: the second call lands in it


class Server:
    """uvicorn (SGLang's HTTP server) serving ``/pause_generation`` in a thread, with its event loop."""

    def __init__(self):
        async def pause(request):
            await request.body()
            if self.busy_once:  # after this answer, once its connection's keep-alive timer is set
                self.busy_once = False
                asyncio.get_running_loop().call_later(0.1, self._busy_as_the_keep_alive_fires)
            return JSONResponse({"status": "ok"})

        app = Starlette(routes=[Route("/pause_generation", pause, methods=["POST"])])
        self.port = free_port("127.0.0.1")
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    timeout_keep_alive=KEEP_ALIVE_S, http="h11"))
        self.busy_once = True
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    def _busy_as_the_keep_alive_fires(self) -> None:
        """Keep this loop busy until just after the idle connection's keep-alive timer is due, then busy
        again (``BUSY_S``) in the loop turn that runs the timer, before it (a loaded server's long turn): a
        request that arrives meanwhile is still unread when the timer closes the connection."""
        (connection,) = self.server.server_state.connections
        if connection.timeout_keep_alive_task is None:  # the answer is not sent yet
            self.loop.call_later(0.02, self._busy_as_the_keep_alive_fires)
            return
        due = connection.timeout_keep_alive_task.when()
        self.loop.call_at(due - 0.05, time.sleep, BUSY_S)  # runs first in the turn that runs the close
        time.sleep(max(0.0, due - self.loop.time() + 0.05))  # past both: the next turn runs them together


async def pause_twice(server: Server) -> None:
    """A pause, an idle ``IDLE_S``, a pause: the second finds the first's connection idle in the pool."""
    server.busy_once = True
    async with SGLangClient(f"http://127.0.0.1:{server.port}", MODEL) as client:
        await client.pause_generation()
        await asyncio.sleep(IDLE_S)
        await client.pause_generation()


@pytest.mark.unit
def test_a_connection_idle_near_the_servers_keep_alive_is_not_reused(monkeypatch):
    with Server() as server:
        monkeypatch.setattr(engine_client, "IDLE_CONNECTION_S", 5.0)  # httpx's default: reused at 1.5 s idle
        with pytest.raises(EngineUnreachable, match=r"/pause_generation: engine unreachable \(ReadError: \)"):
            asyncio.run(pause_twice(server))
        monkeypatch.setattr(engine_client, "IDLE_CONNECTION_S", KEEP_ALIVE_S / 2)  # below the server's timeout
        asyncio.run(pause_twice(server))  # a new connection: answered once the server's loop is free


@pytest.mark.unit
def test_the_clients_idle_limit_is_below_sglangs_keep_alive_timeout():
    """SGLang's default keep-alive timeout, read from its source (importing SGLang takes seconds)."""
    (package,) = importlib.util.find_spec("sglang").submodule_search_locations
    source = (Path(package) / "srt" / "environ.py").read_text()
    (default,) = re.findall(r"SGLANG_TIMEOUT_KEEP_ALIVE = EnvInt\((\d+)\)", source)
    assert engine_client.IDLE_CONNECTION_S < int(default) - 1
