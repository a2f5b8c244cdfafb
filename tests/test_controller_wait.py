"""The data-parallel controller's loop (megarl/engine_process/controller_wait.py) over a real ZMQ socket:
it dispatches every request in order, and between requests it waits where SGLang's own loop spins. The
controller is a stand-in holding the three attributes the loop uses; SGLang's loop is run the same way
for the comparison."""
import threading
import time

import pytest
import zmq
from sglang.srt.managers.data_parallel_controller import DataParallelController
from sglang.srt.managers.io_struct import sock_send

from megarl.engine_process import controller_wait

pytestmark = pytest.mark.unit


class Stop(Exception):
    """Ends a loop's thread: raised by the dispatcher at the request ``None``."""


class StandIn:
    """The controller's socket (PULL, bound to ``address``), its soft watchdog and its dispatcher."""

    def __init__(self, context: zmq.Context, address: str):
        self.recv_from_tokenizer = context.socket(zmq.PULL)
        self.recv_from_tokenizer.bind(address)
        self.dispatched, self.feeds = [], 0
        self.soft_watchdog = self

    def feed(self) -> None:
        self.feeds += 1

    def _request_dispatcher(self, request) -> None:
        if request is None:
            raise Stop
        self.dispatched.append(request)


def idle_cpu_s(loop, address: str, idle_s: float = 1.0) -> tuple[float, list, int]:
    """Run ``loop`` on a stand-in in a thread: two requests, ``idle_s`` of nothing, a third, then the stop.
    (the thread's CPU seconds over the idle stretch, the requests dispatched, the watchdog's feeds)."""
    context = zmq.Context()
    controller, sender = StandIn(context, address), context.socket(zmq.PUSH)
    sender.connect(address)
    clock = []

    def run():
        clock.append(time.pthread_getcpuclockid(threading.get_ident()))
        try:
            loop(controller)
        except Stop:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    sock_send(sender, {"request": 1})
    sock_send(sender, {"request": 2})
    deadline = time.monotonic() + 30
    while len(controller.dispatched) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    before = time.clock_gettime(clock[0])
    time.sleep(idle_s)
    used = time.clock_gettime(clock[0]) - before
    sock_send(sender, {"request": 3})
    sock_send(sender, None)
    thread.join(30)
    assert not thread.is_alive()
    sender.close(linger=0)
    controller.recv_from_tokenizer.close(linger=0)
    context.term()
    return used, controller.dispatched, controller.feeds


def test_the_loop_dispatches_in_order_and_waits_where_sglangs_spins(tmp_path):
    ours, dispatched, feeds = idle_cpu_s(controller_wait.event_loop, f"ipc://{tmp_path / 'ours'}")
    assert dispatched == [{"request": 1}, {"request": 2}, {"request": 3}]
    assert feeds >= 2  # fed at each wake, the idle second's timeout included
    theirs, dispatched, _ = idle_cpu_s(DataParallelController.event_loop, f"ipc://{tmp_path / 'theirs'}")
    assert dispatched == [{"request": 1}, {"request": 2}, {"request": 3}]
    assert ours < 0.02, f"the waiting loop used {ours:.3f} s of CPU in an idle second"
    assert theirs > 0.05, f"SGLang's loop used {theirs:.3f} s in an idle second: no longer spins?"
