"""Entry point of an SGLang server process: ``python -m megarl.engines.sglang_main <launch_server args>``.

Points SGLang's model registry at the served architecture's module alone
(:mod:`megarl.engines.model_registry`), applies megarl's SGLang CPU work-arounds (only when no GPU
is present), keeps SGLang's inter-process tensors on torch's own unpickler
(:mod:`megarl.platform.sglang_ipc`, every platform) and overlaps the receive and the load of
weight-sync buckets (:mod:`megarl.engines.pipelined_load`), then runs SGLang's own
``sglang.launch_server`` main with the same arguments. All are applied at import time on purpose: on
GPU SGLang starts its scheduler and detokenizer with the "spawn" start method, and a spawned child
re-imports this module (as ``__mp_main__``) before it runs any of SGLang's code (the registry's
variables it inherits); on CPU they are forked from this process (``sglang_cpu``'s
``spawn_reimports_sglang``) and inherit all of it.

The server leads its own process group (see ``SGLangEngine``), so nothing reaches it when its owner
is killed with SIGKILL; a watcher thread ends the group when the owner's process goes away, and a
killed driver leaves no server behind.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

from megarl.engines import model_registry
from megarl.gc_pause import gc_paused

with gc_paused():  # most of SGLang is imported here
    model_registry.install(sys.argv[1:])  # before anything imports SGLang's registry
    from megarl.engines import pipelined_load
    from megarl.platform import sglang_cpu, sglang_ipc

    sglang_cpu.apply()
    sglang_ipc.install()
    pipelined_load.install()

OWNER_POLL_S = 1.0


def _end_with_owner(owner: int) -> None:
    """Poll the owner's pid; when this process is re-parented (the owner died), SIGTERM the group."""
    while os.getppid() == owner:
        time.sleep(OWNER_POLL_S)
    os.killpg(os.getpgrp(), signal.SIGTERM)


if __name__ == "__main__":
    threading.Thread(target=_end_with_owner, args=(os.getppid(),), daemon=True, name="owner-watch").start()
    runpy.run_module("sglang.launch_server", run_name="__main__")
