"""Prefix affinity: the requests that share a prefix go to the engine that served the first of them.

A multi-turn episode's turn ``k + 1`` is fed its turn ``k``'s prompt and answer, and the episodes of
one prompt group share their prompt: the engine that served them holds those prefixes in its radix
cache, any other engine computes them again. Rollout gives each request an affinity key (its prompt
group's id: every turn of every episode of the group; an agent's calls add their role, whose prefixes
differ), and the pool places each keyed prompt on the
engine that served that key last, unless the engine is not among those allowed or holds more than
``slack`` in-flight prompts above the least-loaded allowed engine; then the prompt is placed
least-loaded and the key follows it. Keys are kept for the ``capacity`` most recently used (dropping
the oldest loses only a cache hit).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence


class PlacedEngine(Protocol):
    """What placement reads of an engine: its pool index and its in-flight prompts."""

    index: int
    in_flight: int


def least_loaded(load: list[int]) -> int:
    """Position of the smallest load (ties: the first)."""
    return min(range(len(load)), key=load.__getitem__)


class EngineAffinity:
    """Key -> pool index of the engine that served the key's last request (see the module docstring)."""

    def __init__(self, slack: int, capacity: int = 1 << 16):
        if slack < 0 or capacity < 1:
            raise ValueError(f"slack must be >= 0 and capacity >= 1, got {slack}, {capacity}")
        self.slack, self.capacity = slack, capacity
        self._engine_of: OrderedDict[str, int] = OrderedDict()
        self.kept = 0  # prompts with a known key placed on their engine, and those moved off it (counters)
        self.moved = 0

    def place(self, engines: Sequence[PlacedEngine], indices: list[int],
              keys: Sequence[str | None] | None) -> list[tuple[PlacedEngine, list[int]]]:
        """Prompts ``indices`` on ``engines``: [(engine, its indices)], engines with none omitted.
        ``keys[i]`` (None: no affinity) is prompt ``i``'s key; without keys, least-loaded placement."""
        load = [e.in_flight for e in engines]
        position = {e.index: k for k, e in enumerate(engines)}
        parts: list[list[int]] = [[] for _ in engines]
        for i in indices:
            key = keys[i] if keys is not None else None
            best = least_loaded(load)
            known = position.get(self._engine_of.get(key, -1)) if key is not None else None
            if known is not None and load[known] <= load[best] + self.slack:
                best = known
                self.kept += 1
            elif known is not None:
                self.moved += 1
            parts[best].append(i)
            load[best] += 1
            if key is not None:
                self._remember(key, engines[best].index)
        return [(engines[k], part) for k, part in enumerate(parts) if part]

    def _remember(self, key: str, index: int) -> None:
        self._engine_of[key] = index
        self._engine_of.move_to_end(key)
        if len(self._engine_of) > self.capacity:
            self._engine_of.popitem(last=False)
