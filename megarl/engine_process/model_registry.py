"""SGLang's model registry with the served architecture's model only, not every model SGLang has.

SGLang's registry imports all ~260 modules of ``sglang.srt.models`` when it is first imported (a
cost paid by every engine start), unless ``SGLANG_EXTERNAL_MODEL_PACKAGE``
names a package of models: then it imports that package only, resolves an architecture found there
at once and imports the default models only for one it does not (its "fast startup path",
``sglang/srt/models/registry.py``). :func:`install` points that variable at
:mod:`megarl.engine_process.sglang_models`, whose one module re-exports the ``EntryClass`` of the SGLang
module that defines the served checkpoint's first architecture (found by reading the sources, not by
importing them). Anything else resolves through SGLang's full import: another
architecture, ``--model-impl transformers``, a draft model. A user's own
``SGLANG_EXTERNAL_MODEL_PACKAGE`` is left as it is.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
from pathlib import Path

PACKAGE = "megarl.engine_process.sglang_models"
MODULE_VARIABLE = "MEGARL_SGLANG_MODEL_MODULE"  # read by megarl.engine_process.sglang_models.served
ENTRY_CLASS = re.compile(r"^EntryClass\s*=\s*(\[[^\]]*\]|[^\n]*)", re.MULTILINE)  # a name or a list of names
DEFINED_CLASS = re.compile(r"^class (\w+)", re.MULTILINE)


def served_architectures(server_args: list[str]) -> list[str]:
    """The architectures SGLang resolves for these ``launch_server`` arguments: those of
    ``--json-model-override-args`` if it has any, else the ``config.json`` of a local
    ``--model-path``; [] when neither says (e.g. a hub id). Raises ValueError naming the flag when
    its value is not a JSON object."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model-path")
    parser.add_argument("--json-model-override-args", default="{}")
    known, _ = parser.parse_known_args(server_args)
    try:
        override = json.loads(known.json_model_override_args or "{}").get("architectures")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"--json-model-override-args is not a JSON object: "
                         f"{known.json_model_override_args!r} ({exc})") from exc
    if override:
        return list(override)
    config = Path(known.model_path or "") / "config.json"
    if not known.model_path or not config.is_file():
        return []
    return list(json.loads(config.read_text()).get("architectures") or [])


def defining_module(architecture: str) -> str | None:
    """The ``sglang.srt.models`` module that defines ``class <architecture>`` and names it in its
    ``EntryClass`` (read from the sources, nothing imported); None if no module does both."""
    return _registered_by_source().get(architecture)


def ties_embeddings(architecture: str) -> bool | None:
    """Whether SGLang's model of ``architecture`` shares its output layer with the embedding table when the
    checkpoint's ``tie_word_embeddings`` says so: its module reads that key (read from the source, nothing
    imported; Qwen3's does, Qwen3-MoE's builds its own ``lm_head`` whatever the key says). None when no
    SGLang module defines the architecture."""
    module = defining_module(architecture)
    if module is None:
        return None
    return "tie_word_embeddings" in (_models_dir() / f"{module.rsplit('.', 1)[1]}.py").read_text(errors="replace")


def _models_dir() -> Path:
    return Path(importlib.util.find_spec("sglang.srt.models").submodule_search_locations[0])


@functools.cache
def _registered_by_source() -> dict[str, str]:
    """Architecture -> module, for the classes each ``sglang.srt.models`` module defines and registers."""
    found: dict[str, str] = {}
    for path in sorted(_models_dir().glob("*.py")):
        source = path.read_text(errors="replace")
        entry = ENTRY_CLASS.search(source)
        if entry is not None:
            defined = set(DEFINED_CLASS.findall(source))
            for name in re.findall(r"\w+", entry.group(1)):
                if name in defined:
                    found.setdefault(name, f"sglang.srt.models.{path.stem}")
    return found


def install(server_args: list[str]) -> str | None:
    """Set the two variables (inherited by the server's children) before SGLang's registry is
    imported; returns the module the registry will import, or None where SGLang imports every
    model as usual (the variable already set, or no architecture found)."""
    if os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE"):
        return None
    architectures = served_architectures(server_args)
    module = defining_module(architectures[0]) if architectures else None
    if module is not None:
        os.environ[MODULE_VARIABLE] = module
        os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = PACKAGE
    return module
