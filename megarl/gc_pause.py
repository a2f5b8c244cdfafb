"""Start-up imports with Python's cyclic garbage collector paused.

A trainer rank importing megatron-core and megatron-bridge, or an engine server importing SGLang,
allocates millions of long-lived objects and frees almost none, while the collector walks them
again every few hundred allocations to no avail. :func:`gc_paused` wraps those imports; the
collector is back as it was when the block ends (cycles made inside it are collected on its next pass).
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block; re-enable it after, if it was enabled before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
