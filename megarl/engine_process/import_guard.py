"""Packages an SGLang server process never imports, refused by an import hook.

SGLang's debug dumper (``sglang/srt/debug_utils/dumper.py``, ``_MegatronPlugin``) imports
``megatron.core`` wherever it is installed, to describe megatron's parallel state when a megatron
process dumps tensors. megarl's environment always has megatron, so every SGLang server would import
megatron.core, and with it torch's C++-extension module and setuptools, at each start, and use none
of it. :func:`keep_out` makes importing such a package raise ``ModuleNotFoundError`` saying why,
which the dumper takes for "not installed".
"""
from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Iterable

SERVER_KEPT_OUT = ("megatron",)  # top-level packages an SGLang server process does not import
SERVER_REASON = "an SGLang server never uses it (SGLang's debug dumper would import it at every start)"


class KeptOut(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that refuses the top-level packages ``names`` and their submodules."""

    def __init__(self, names: Iterable[str], reason: str):
        self.names, self.reason = frozenset(names), reason

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"{fullname} is kept out of this process: {self.reason}", name=fullname)
        return None


def keep_out(names: Iterable[str], reason: str) -> KeptOut:
    """Refuse ``names`` (top-level packages) from now on in this process: a finder put first on
    ``sys.meta_path``, returned (removing it from there undoes it). Modules already imported stay."""
    finder = KeptOut(names, reason)
    sys.meta_path.insert(0, finder)
    return finder
