"""A named work-around for a library failure on CPU, and the switch that turns single ones off."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workaround:
    name: str
    prevents: str  # the error the library raises on CPU without it
    apply: Callable[[], None]


def turned_off(off_env: str, known: Iterable[str]) -> set[str]:
    """Names listed in ``$off_env`` (comma-separated); ValueError for a name not in ``known``."""
    off = {name.strip() for name in os.environ.get(off_env, "").split(",") if name.strip()}
    unknown = off - set(known)
    if unknown:
        raise ValueError(f"{off_env}: unknown work-around(s) {sorted(unknown)}")
    return off


def apply_enabled(workarounds: Sequence[Workaround], off_env: str, also_known: Iterable[str] = ()) -> list[str]:
    """Apply each work-around not turned off in ``$off_env``; returns the names applied."""
    off = turned_off(off_env, [w.name for w in workarounds] + list(also_known))
    applied = []
    for workaround in workarounds:
        if workaround.name in off:
            log.warning("CPU work-around %r turned off by %s", workaround.name, off_env)
            continue
        workaround.apply()
        applied.append(workaround.name)
    return applied
