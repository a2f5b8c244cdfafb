"""Config fields that carry their own bounds: a dataclass field's default with the range or the names it
may take, declared once beside the field (``dataclasses.field`` metadata) and checked by one walker
(:func:`megarl.fields.out_of_bounds`) for every section of the schema.

A component that owns a config section declares its dataclass with these fields; the schema
(``megarl/config/schema.py``) nests it. None (an ``Optional`` field left unset) is never checked.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable

BOUNDS = "megarl_bounds"  # the metadata key of a field's Bounds


@dataclass(frozen=True)
class Bounds:
    """What a field's value may be: ``ge`` <= v, ``gt`` < v, v <= ``le``, v < ``lt`` (numbers), one of
    ``choices`` (names), or one of ``also`` (a sentinel outside the range, e.g. -1 for "off")."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None
    also: tuple = ()

    def why_not(self, value: Any) -> str | None:
        """Why ``value`` is out of bounds (one line), None when it is in."""
        if value in self.also:
            return None
        if self.choices is not None:
            return None if value in self.choices else f"{value!r} is not one of {', '.join(map(str, self.choices))}"
        inside = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                  and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        return None if inside else f"must be {self.describe()}, got {value}"

    def describe(self) -> str:
        """The range in words: ``>= 1``, ``in (0, 1]``, ``>= 1 or -1``."""
        low = [f"{op} {_num(v)}" for op, v in ((">=", self.ge), (">", self.gt)) if v is not None]
        high = [f"{op} {_num(v)}" for op, v in (("<=", self.le), ("<", self.lt)) if v is not None]
        if low and high:
            text = f"in {'[' if self.ge is not None else '('}{_num(self.ge if self.ge is not None else self.gt)}, " \
                   f"{_num(self.le if self.le is not None else self.lt)}{']' if self.le is not None else ')'}"
        else:
            text = (low + high)[0] if low or high else "any number"
        return text + "".join(f" or {a}" for a in self.also)


def setting(default: Any = dataclasses.MISSING, *, default_factory: Callable | Any = dataclasses.MISSING,
            ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
            choices: tuple | None = None, also: tuple = ()) -> Any:
    """A dataclass field with ``default`` (or ``default_factory``) and its :class:`Bounds`."""
    bounds = Bounds(ge=ge, gt=gt, le=le, lt=lt, choices=tuple(choices) if choices is not None else None,
                    also=tuple(also))
    return dataclasses.field(default=default, default_factory=default_factory, metadata={BOUNDS: bounds})


def bounds_of(field: dataclasses.Field) -> Bounds | None:
    """The bounds a field was declared with (:func:`setting`), None for a field without."""
    return field.metadata.get(BOUNDS)


def _children(cls) -> list[tuple[dataclasses.Field, type | None, bool]]:
    """(field, the dataclass it nests or None, whether it is a list of them) for each field of ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            out.append((f, hint, False))
        elif typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            out.append((f, args[0], True))
        else:
            out.append((f, None, False))
    return out


def out_of_bounds(node: Any, cls: type, prefix: str = "") -> tuple[str, str] | None:
    """The first key of ``node`` (an instance of dataclass ``cls``, or an OmegaConf node of it) whose value
    is outside its :class:`Bounds`, with why: ``("rollout.top_p", "must be in (0, 1], got 2.0")``; nested
    sections and lists of them are walked (``task.role_engines[0].engine_tp``). None when all are in."""
    for f, nested, is_list in _children(cls):
        if nested is None and bounds_of(f) is None:
            continue  # nothing to check (and a mandatory value left unset is read by no one here)
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if nested is not None and value is not None:
            items = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if is_list else [(key, value)]
            for item_key, item in items:
                found = out_of_bounds(item, nested, f"{item_key}.")
                if found is not None:
                    return found
            continue
        bounds = bounds_of(f)
        why = None if bounds is None or value is None else bounds.why_not(value)
        if why is not None:
            return key, why
    return None


def check_bounds(obj: Any, prefix: str = "") -> None:
    """ValueError naming the first field of dataclass instance ``obj`` outside its bounds (``prefix``: its
    section's key, e.g. ``"sync."``)."""
    found = out_of_bounds(obj, type(obj), prefix)
    if found is not None:
        raise ValueError(f"{found[0]}: {found[1]}")


def _num(value: float) -> str:
    """1.0 -> "1", 0.5 -> "0.5"."""
    return str(int(value)) if float(value).is_integer() else str(value)
