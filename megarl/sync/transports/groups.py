"""The links' process groups on the trainer's side: their backend on this platform and the environment
they are made in (``distributed``'s and ``sharded``'s groups; the rank's address carries the backend to the
engines)."""
from __future__ import annotations

import contextlib
import os

from megarl.platform.description import Platform, detect


def link_backend(platform: Platform | None = None) -> str:
    """The link's backend on ``platform`` (default: this process's): NCCL on CUDA, else gloo."""
    return "nccl" if (detect() if platform is None else platform).is_cuda else "gloo"


def group_environment(backend: str) -> dict[str, str]:
    """Environment variables in force while the sender's group is made: NCCL's watchdog reads its
    error handling when a group is constructed; off (``0``, as torch's ``_abort_process_group``
    asks) it leaves a timed-out collective to the sender instead of ending the trainer's process."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"} if backend == "nccl" else {}


@contextlib.contextmanager
def made_in(overrides: dict[str, str]):
    """Set ``overrides`` in this process's environment while a group is made; the old values come back after."""
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
