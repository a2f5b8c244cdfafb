"""The data-parallel controller waits on its socket instead of spinning (installed on every platform).

SGLang 0.5.23's ``DataParallelController.event_loop`` (``sglang/srt/managers/data_parallel_controller.py``,
the process between the tokenizer and the schedulers of an engine with ``--attn-dp-size`` or ``--dp-size``
above 1) reads the tokenizer's socket with ``zmq.NOBLOCK`` and, finding nothing, tries again at once: the
controller burns a core for as long as the engine is up, one the engine's schedulers (and on CPU the rest of
the machine) need.

:func:`install` gives the controller :func:`event_loop`: it blocks in a ``zmq.Poller`` on that socket (at
most ``WAIT_MS``, feeding SGLang's soft watchdog at every wake), then dispatches every request waiting, in
order, as SGLang's loop does.
"""
from __future__ import annotations

WAIT_MS = 1000  # the longest wait between two feeds of the controller's soft watchdog


def event_loop(controller) -> None:
    """Dispatch the tokenizer's requests to ``controller`` (a ``DataParallelController``) as they come, waiting
    on the socket in between; never returns."""
    import zmq
    from sglang.srt.managers import data_parallel_controller as dpc

    poller = zmq.Poller()
    poller.register(controller.recv_from_tokenizer, zmq.POLLIN)
    while True:
        controller.soft_watchdog.feed()
        poller.poll(WAIT_MS)
        while True:
            try:
                request = dpc.sock_recv(controller.recv_from_tokenizer, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            controller._request_dispatcher(request)


def install() -> None:
    """Make :func:`event_loop` the controller's loop in this process (idempotent)."""
    from sglang.srt.managers.data_parallel_controller import DataParallelController

    DataParallelController.event_loop = event_loop
