"""Config-name lookup shared by the algorithm tables (advantage, policy loss, aggregation, KL, ...)."""
from __future__ import annotations

from typing import Mapping, TypeVar

T = TypeVar("T")


def choose(table: Mapping[str, T], name: str, what: str) -> T:
    """``table[name]``; an unknown ``name`` raises ValueError naming ``what`` and the valid names."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(sorted(table))}") from None
