"""POSIX shared-memory segments (``/dev/shm``) that SIGKILLed processes leave behind.

A segment's name stays until someone unlinks it; torch and SGLang unlink theirs in code that a SIGKILL
skips, and Ray kills actors and their process trees that way. These helpers tell which segments a live
process still maps (those must stay: torch aborts when it cannot unlink a segment it frees) and unlink
the others; the owners of the names decide which are theirs
(:func:`megarl.engines.server.remove_orphaned_scratch`,
:func:`megarl.sync.transports.tensor.remove_orphaned_segments`).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SHARED_MEMORY = Path("/dev/shm")


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def mapped_segments() -> set[str]:
    """Names of the ``/dev/shm`` files some process of this machine maps (from ``/proc/*/maps``)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or not readable
            continue
        mapped.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in text.splitlines() if "/dev/shm/" in line)
    return mapped


def unlink_unmapped(names: Iterable[str], mapped: set[str]) -> list[str]:
    """Unlink the segments of ``names`` not in ``mapped``; returns those unlinked (absent ones are skipped)."""
    removed = []
    for name in names:
        if name in mapped:
            continue
        try:
            (SHARED_MEMORY / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
