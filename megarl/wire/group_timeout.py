"""A weight-update group's bound, carried in the group's name: SGLang's ``/init_weights_update_group``
request has no timeout field, so the driver marks the name (:func:`timed_name`: ``<name>.timeout<ms>ms``)
and the engine reads it back when it joins (:func:`timeout_of`, used by
:mod:`megarl.engine_process.update_group`)."""
from __future__ import annotations

import datetime
import re

_MARK = re.compile(r"\.timeout(\d+)ms$")


def timed_name(name: str, timeout_s: float) -> str:
    """``name`` marked with the bound ``timeout_s`` (seconds, > 0) for the engines that join it."""
    if not timeout_s > 0:
        raise ValueError(f"a weight-update group's timeout must be > 0 s, got {timeout_s}")
    return f"{name}.timeout{max(1, round(timeout_s * 1000))}ms"


def timeout_of(name: str) -> datetime.timedelta | None:
    """The bound marked in group ``name`` by :func:`timed_name`; None for a name without the mark."""
    match = _MARK.search(name)
    return None if match is None else datetime.timedelta(milliseconds=int(match.group(1)))
