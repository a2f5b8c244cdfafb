"""Every numeric and enumerated key of the schema is checked at load: an out-of-range value, a name that is
not one of the key's, and a value of the wrong type each make ``python -m megarl.train`` exit 2 within
seconds with one line naming the key (the driver in-process, one load per case)."""
from __future__ import annotations

import dataclasses
import enum
import time
import typing

import pytest

from megarl.config.schema import MegarlConfig
from megarl.fields import bounds_of
from megarl.train import main

pytestmark = pytest.mark.unit

LOAD_LIMIT_S = 10.0
# keys inside a list's entries are set through the list: one entry holding the bad value
LIST_ENTRY = {"task.role_engines": "role:verifier"}


def _leaves(cls, prefix=""):
    """(key, field, its type, the list key it sits in or None) for every leaf of the schema."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if dataclasses.is_dataclass(hint):
            yield from _leaves(hint, f"{key}.")
        elif typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            yield from ((k, fl, t, key) for k, fl, t, _ in _leaves(args[0], f"{key}[0]."))
        else:
            yield key, f, (args[0] if typing.get_origin(hint) is typing.Union else hint), None


LEAVES = list(_leaves(MegarlConfig))
NUMERIC = [(k, f, t, lst) for k, f, t, lst in LEAVES if t in (int, float)]
ENUMERATED = [(k, f, t, lst) for k, f, t, lst in LEAVES
              if (isinstance(t, type) and issubclass(t, enum.Enum)) or (bounds_of(f) and bounds_of(f).choices)]


def _outside(f: dataclasses.Field, kind: type) -> list:
    """Values just outside the field's range: the excluded bound itself, or one step past an included one."""
    b, step = bounds_of(f), 1 if kind is int else 0.5
    out = [b.gt] if b.gt is not None else [b.ge - step] if b.ge is not None else []
    out += [b.lt] if b.lt is not None else [b.le + step] if b.le is not None else []
    return [kind(v) if kind is int else float(v) for v in out]


def _override(key: str, value, in_list: str | None) -> tuple[str, str]:
    """The command-line override that sets ``key`` to ``value``, and the key the error must name."""
    if in_list is None:
        return f"{key}={value}", key
    leaf = key.rsplit(".", 1)[1]
    return f"{in_list}=[{{{LIST_ENTRY[in_list]},{leaf}:{value}}}]", in_list


CASES = [(f"{k}={v}", k, v, lst) for k, f, t, lst in NUMERIC for v in _outside(f, t)]
CASES += [(f"{k}=abc", k, "not_a_number", lst) for k, f, t, lst in NUMERIC]
CASES += [(f"{k}=nope", k, "nope", lst) for k, f, t, lst in ENUMERATED]


def test_every_numeric_and_enumerated_key_declares_its_range():
    unbounded = [k for k, f, t, _ in NUMERIC if bounds_of(f) is None or not _outside(f, t)]
    assert not unbounded, f"numeric keys without a range: {unbounded}"
    assert len(NUMERIC) > 80 and len(ENUMERATED) > 20  # the walk reaches every section


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> list[str]:
    """Paths a run would write, in a temporary directory (a check that failed to fire cannot touch the checkout)."""
    root = tmp_path_factory.mktemp("keys")
    return ["recipe=tiny_moe_cpu", f"model.hf_path={root / 'base'}", f"warmup.save_hf_path={root / 'sft'}",
            f"logging.run_dir={root / 'run'}"]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_bad_value_exits_2_naming_the_key(case, sandbox, capsys):
    _, key, value, in_list = case
    override, named = _override(key, value, in_list)
    t0 = time.monotonic()
    assert main([*sandbox, override]) == 2, capsys.readouterr().err[-2000:]
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    # a list entry's key is named with its entry (task.role_engines[0].engine_tp) or after the list's
    assert err.startswith(f"megarl: config error: {named}" + (": " if in_list is None else "")), err
    assert in_list is None or key.rsplit(".", 1)[1] in err, err
    assert elapsed < LOAD_LIMIT_S, f"{elapsed:.1f} s"


def test_top_k_beyond_the_vocabulary_is_refused(sandbox, capsys):
    """Top-k over the whole vocabulary keeps every token: the sampling mask would be off."""
    assert main([*sandbox, "rollout.top_k=100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megarl: config error: rollout.top_k: 100000 is not below the model's vocabulary of 384 "
                          "tokens"), err
    assert main([*sandbox, "rollout.top_k=-1"]) == 2  # no top-k: no sampling mask either
    assert "Keep Sampling Mask needs a finite top_k" in capsys.readouterr().err
