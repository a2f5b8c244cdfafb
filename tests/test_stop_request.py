"""Stop requests (megarl/pipeline/signals.py), in a fresh interpreter that signals itself inside
``asyncio.run`` as the driver runs. Ctrl-C during the RL steps: the first SIGINT is a stop request,
the next one cancels the run at once (asyncio's own handling: KeyboardInterrupt out of
``asyncio.run``); outside the block, or where SIGINT is ignored, nothing changes. During start-up a
SIGTERM, or one that came before it, cancels it. End to end: the first Ctrl-C of a real run
(checkpoint, exit 0, resumable) in tests/test_rl_resume_lora.py, SIGTERM during start-up in
tests/test_rl_resume.py."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

SCENARIO = """
import asyncio, os, signal, sys
from megarl.pipeline.signals import StopRequest

case = sys.argv[1]
# as a terminal's foreground job has it, whatever the test runner inherited (a background job ignores it)
signal.signal(signal.SIGINT, signal.SIG_IGN if case == "ignored" else signal.default_int_handler)


def interrupt(sig=signal.SIGINT):
    os.kill(os.getpid(), sig)


async def main():
    if case in ("start_up", "before_start_up"):
        StopRequest.install()
        if case == "before_start_up":
            interrupt(signal.SIGTERM)
        with StopRequest.cancels_the_start_up():
            if case == "start_up":
                interrupt(signal.SIGTERM)
            await asyncio.sleep(10)
        print("not cancelled", flush=True)
    if case == "after_the_block":
        with StopRequest.ctrl_c_stops_after_the_step():
            pass
        interrupt()
        await asyncio.sleep(10)
    with StopRequest.ctrl_c_stops_after_the_step():
        if case == "sigterm_first":  # a scheduler asked first: Ctrl-C now means at once
            StopRequest.install()
            interrupt(signal.SIGTERM)
        else:
            interrupt()
        await asyncio.sleep(0.2)
        print("stop requested by", StopRequest.signal_name, flush=True)
        if case in ("twice", "sigterm_first"):
            interrupt()
            await asyncio.sleep(10)
            print("not cancelled", flush=True)
    print("block ended", flush=True)

try:
    asyncio.run(main())
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
except asyncio.CancelledError:
    print("start-up cancelled by", StopRequest.signal_name, flush=True)
"""


@pytest.mark.parametrize("case, expected", [
    ("once", ["stop requested by SIGINT", "block ended"]),
    ("twice", ["stop requested by SIGINT", "KeyboardInterrupt"]),
    ("sigterm_first", ["stop requested by SIGTERM", "KeyboardInterrupt"]),
    ("after_the_block", ["KeyboardInterrupt"]),
    ("ignored", ["stop requested by None", "block ended"]),
    ("start_up", ["start-up cancelled by SIGTERM"]),
    ("before_start_up", ["start-up cancelled by SIGTERM"]),
])
def test_stop_requests_by_signal(case, expected):
    out = subprocess.run([sys.executable, "-c", SCENARIO, case], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == expected, out.stdout + out.stderr
