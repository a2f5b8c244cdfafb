"""megatron-bridge's ``AutoBridge`` with the checkpoint's model bridge registered, not every family's.

``import megatron.bridge`` imports the bridges and providers of all ~60 model families it has (and
through them transformers' vision and audio models, torchvision, scipy), because its ``__init__``
and that of ``megatron.bridge.models`` import them to fill the registry, a cost paid by every rank of
a job that one family's import mostly avoids.
:func:`auto_bridge_for` makes the two package modules without running their ``__init__`` (their
submodules import as usual), then imports ``AutoBridge`` and the module that registers the
checkpoint's architecture (``@MegatronModelBridge.register_bridge(source=...)``, found by reading
the sources, not by importing them). When no module is found for an architecture, or when a caller
needs the whole registry (:func:`full_auto_bridge`: "which models are supported?"), the packages'
``__init__`` run after all, into the same module objects, and every family is registered as usual.
"""
from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path

PACKAGES = ("megatron.bridge", "megatron.bridge.models")  # parent first
# a class decorator at the start of a line (not an example in a docstring): source=Class, "Name" or CONSTANT
REGISTRATION = re.compile(r"^@[\w.]*register_bridge\(\s*source\s*=\s*(?:[\"'](\w+)[\"']|(\w+))", re.MULTILINE)
CONSTANT = r"^{}\s*(?::\s*\w+\s*)?=\s*[\"'](\w+)[\"']"  # NAME = "Architecture" (NAME: str = ... too)
_skipped: dict[str, importlib.machinery.ModuleSpec] = {}  # package -> its spec while its __init__ has not run


def registering_module(architecture: str) -> str | None:
    """The ``megatron.bridge`` module whose ``register_bridge(source=...)`` names ``architecture`` (a
    class name, or the string given for auto_map models); None when no module does."""
    return _registered_by_source().get(architecture)


@functools.cache
def _registered_by_source() -> dict[str, str]:
    """Architecture -> module, for every ``register_bridge(source=...)`` in megatron-bridge's sources."""
    spec = importlib.util.find_spec("megatron.bridge")
    root = Path(spec.submodule_search_locations[0])
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(errors="replace")
        if "register_bridge(" not in source:
            continue
        parts = path.relative_to(root.parent.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for quoted, name in REGISTRATION.findall(source):
            constant = re.search(CONSTANT.format(re.escape(name)), source, re.MULTILINE) if name else None
            found.setdefault(quoted or (constant.group(1) if constant else name), module)
    return found


def auto_bridge_for(architectures: Sequence[str]) -> type:
    """``AutoBridge``, with at least the bridges of ``architectures`` registered (only theirs when
    megatron-bridge was not imported before and the sources name a module for each)."""
    modules = [registering_module(a) for a in architectures]
    if not modules or None in modules or ("megatron.bridge" in sys.modules and not _skipped):
        return full_auto_bridge()
    _skip_package_inits()
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge

    for module in modules:
        importlib.import_module(module)
    sys.modules["megatron.bridge"].AutoBridge = AutoBridge  # what `from megatron.bridge import AutoBridge` reads
    return AutoBridge


def full_auto_bridge() -> type:
    """``AutoBridge`` with every family registered: ``import megatron.bridge`` as megatron-bridge
    means it, completing the packages' ``__init__`` where :func:`auto_bridge_for` skipped them."""
    for name in reversed(PACKAGES):  # megatron.bridge's __init__ takes megatron.bridge.models as imported
        spec = _skipped.pop(name, None)
        if spec is not None:
            spec.loader.exec_module(sys.modules[name])
    from megatron.bridge import AutoBridge

    return AutoBridge


def _skip_package_inits() -> None:
    """Put the packages of :data:`PACKAGES` in ``sys.modules`` with their ``__path__`` but without
    running their ``__init__`` (a no-op when they are there)."""
    for name in PACKAGES:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, module)
        _skipped[name] = spec
