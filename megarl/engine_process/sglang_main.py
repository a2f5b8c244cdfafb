"""Entry point of an SGLang server process: ``python -m megarl.engine_process.sglang_main <launch_server args>``.

Keeps megatron out of the server's imports (:mod:`megarl.engine_process.import_guard`), points SGLang's model
registry at the served architecture's module alone (:mod:`megarl.engine_process.model_registry`), applies
megarl's SGLang CPU work-arounds (only when no GPU is present), keeps SGLang's inter-process tensors
on torch's own unpickler (:mod:`megarl.engine_process.ipc`, every platform) and overlaps the receive and the load of
weight-sync buckets (:mod:`megarl.engine_process.pipelined_load`), bounds its weight-update groups by the
driver's ``sync.timeout_s`` (:mod:`megarl.engine_process.update_group`), keeps the routes a request's prefix was
computed with, sent with it or kept at a retraction (:mod:`megarl.engine_process.kept_routes`), and replays
them when the prefix is computed again (:mod:`megarl.engine_process.route_replay`; ``MEGARL_ROUTE_REPLAY=off``
in the environment leaves the replay out, for ``tools/bench/route_replay.py``'s baseline), answers a
request's per-token metadata as binary arrays when it asks (:mod:`megarl.engine_process.compact_metadata`),
lets a paused scheduler wait on its sockets rather than spin (:mod:`megarl.engine_process.paused_wait`) and the
data-parallel controller on its socket (:mod:`megarl.engine_process.controller_wait`), then
runs SGLang's own
``sglang.launch_server`` main with the same arguments. All are applied at import time on purpose: on
GPU SGLang starts its scheduler and detokenizer with the "spawn" start method, and a spawned child
re-imports this module (as ``__mp_main__``) before it runs any of SGLang's code (the registry's
variables it inherits); on CPU they are forked from this process (``sglang_cpu``'s
``spawn_reimports_sglang``) and inherit all of it.

The server leads its own process group (see ``SGLangEngine``), so nothing reaches it when its owner
is killed with SIGKILL; a watcher thread ends the group when the owner's process goes away (SIGTERM,
then SIGKILL after ``OWNER_GONE_GRACE_S``), and a killed driver leaves no server behind. The watch
is on the owner process (a pidfd), not on the thread that started the server, as
``PR_SET_PDEATHSIG`` would be: an engine actor's threads come and go, the process stays.

The API key comes in the environment variable ``API_KEY_ENV`` (never on a command line, which
every user of the node can read), removed from the environment and handed to SGLang as
``--api-key`` in this process's own argument list.
"""
from __future__ import annotations

import os
import runpy
import select
import signal
import sys
import threading

from megarl.engine_process import import_guard, model_registry
from megarl.gc_pause import gc_paused
from megarl.wire.launch import API_KEY_ENV, SKIP_TOKENIZER_FLAG

import_guard.keep_out(import_guard.SERVER_KEPT_OUT, import_guard.SERVER_REASON)
with gc_paused():  # most of SGLang is imported here
    model_registry.install(sys.argv[1:])  # before anything imports SGLang's registry
    from megarl.engine_process import (
        compact_metadata,
        controller_wait,
        ipc,
        kept_routes,
        paused_wait,
        pipelined_load,
        route_replay,
        tokenizer_stops,
        update_group,
    )
    from megarl.platform import sglang_cpu

    sglang_cpu.apply()
    ipc.install()
    pipelined_load.install()
    update_group.install()
    kept_routes.install()
    compact_metadata.install()
    if os.environ.get(route_replay.OFF_ENV) != "off":
        route_replay.install()
    else:
        print(f"{route_replay.OFF_ENV}=off: recomputed prefixes are routed afresh", file=sys.stderr)
    paused_wait.install()
    controller_wait.install()
    if SKIP_TOKENIZER_FLAG in sys.argv:
        tokenizer_stops.install()

OWNER_GONE_GRACE_S = 3.0  # SIGTERM's time to unlink SGLang's shared memory before the group is killed


def _end_with_owner(owner_pidfd: int) -> None:
    """Block until the owner process exits, then end this server's process group: SIGTERM, and
    SIGKILL for whatever is left after ``OWNER_GONE_GRACE_S``."""
    select.select([owner_pidfd], [], [])
    os.killpg(os.getpgrp(), signal.SIGTERM)
    threading.Event().wait(OWNER_GONE_GRACE_S)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _watch_owner() -> None:
    """Start the owner watch; a parent already gone (this process re-parented) ends the group at once."""
    owner = os.getppid()
    try:
        owner_pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        owner_pidfd = None
    if owner_pidfd is None or os.getppid() != owner:  # the owner died before the pidfd was opened
        os.killpg(os.getpgrp(), signal.SIGKILL)
    threading.Thread(target=_end_with_owner, args=(owner_pidfd,), daemon=True, name="owner-watch").start()


def _api_key_into_args() -> None:
    """Move the API key from the environment into SGLang's arguments (this process's list only)."""
    key = os.environ.pop(API_KEY_ENV, None)
    if key:
        sys.argv.append(f"--api-key={key}")  # one word: a key may start with "-" (token_urlsafe)


if __name__ == "__main__":
    _watch_owner()
    _api_key_into_args()
    runpy.run_module("sglang.launch_server", run_name="__main__")
