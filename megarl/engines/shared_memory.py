"""POSIX shared-memory segments (``/dev/shm``) that SIGKILLed processes leave behind.

A segment's name stays until someone unlinks it; torch and SGLang unlink theirs in code that a SIGKILL
skips, and Ray kills actors and their process trees that way. These helpers tell which segments a live
process still maps (those must stay: torch aborts when it cannot unlink a segment it frees) and unlink
the others; the owners of the names decide which are theirs
(:func:`megarl.engines.server.remove_orphaned_scratch`,
:func:`megarl.sync.transports.tensor.remove_orphaned_segments`).
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SHARED_MEMORY = Path("/dev/shm")


def mapped_segments(pids: Iterable[int] | None = None) -> set[str]:
    """Names of the ``/dev/shm`` files mapped by ``pids`` (every process of this machine when None),
    from ``/proc/<pid>/maps``; a process that is gone or unreadable counts as mapping none."""
    maps = [Path(f"/proc/{pid}/maps") for pid in pids] if pids is not None else Path("/proc").glob("[0-9]*/maps")
    mapped = set()
    for path in maps:
        try:
            text = path.read_text()
        except OSError:
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
