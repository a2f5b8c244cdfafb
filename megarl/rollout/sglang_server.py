"""Entry point of an SGLang server process: ``python -m megarl.rollout.sglang_server <launch_server args>``.

Applies megarl's SGLang CPU work-arounds (only when no GPU is present) and then runs SGLang's own
``sglang.launch_server`` main with the same arguments. The work-arounds are applied at import time on
purpose: SGLang starts its scheduler and detokenizer with the "spawn" start method, and a spawned
child re-imports this module (as ``__mp_main__``) before it imports any of sglang.
"""
from __future__ import annotations

import runpy

from megarl.platform import sglang_cpu

sglang_cpu.apply()

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__")
