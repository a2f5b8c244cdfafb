"""Start-up imports with Python's cyclic garbage collector paused.

A trainer rank importing megatron-core and megatron-bridge, or an engine server importing SGLang,
allocates millions of long-lived objects and frees almost none, while the collector walks them
again every few hundred allocations: on this 2-core machine (2026-12-02) ``import megatron.bridge``
took 8.2-8.7 CPU-s with the collector and 7.0-7.5 without, SGLang's server stack 9.4-9.8 against
7.7-7.8. :func:`gc_paused` wraps those imports; the collector is back as it was when the block ends
(cycles made inside it are collected on its next pass).
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
