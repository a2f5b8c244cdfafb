"""Compose a recipe with command-line overrides into a validated :class:`MegarlConfig`.

``recipe=NAME`` picks ``recipes/NAME.yaml`` (or a path to a YAML file); every other argument is a
Hydra override (``key=value``, ``+key=value``, ``~key``). Errors are raised as :class:`ConfigError`
with one line that names the offending key and why.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from megarl.config.errors import ConfigError, fail
from megarl.config.schema import MegarlConfig
from megarl.config.validate import validate

SCHEMA_NAME = "megarl_schema"


def default_config() -> DictConfig:
    """The schema's defaults as a structured config that may be changed (``model.hf_path`` unset): the one
    source of defaults for settings built outside a recipe (tests, tools)."""
    return _writable(OmegaConf.structured(MegarlConfig))


def _writable(node: DictConfig) -> DictConfig:
    """``node`` with the read-only flag its frozen dataclasses set cleared at every level, in place: Hydra
    merges the recipe and the overrides into it (the typed config :func:`load_config` returns is frozen)."""
    node._set_flag("readonly", None)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
        elif isinstance(child, ListConfig):
            child._set_flag("readonly", None)
            for item in [] if child._is_none() or child._is_missing() else child:
                if isinstance(item, DictConfig):
                    _writable(item)
    return node


def recipes_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "recipes"


@functools.cache
def _schema_keys() -> DictConfig:
    """The schema as a structured config (read-only), built once: the reference of :func:`_unknown_keys`."""
    schema = OmegaConf.structured(MegarlConfig)
    OmegaConf.set_readonly(schema, True)
    return schema


def _register_schema() -> None:
    """Put the schema in Hydra's config store, once per process (storing converts the whole schema)."""
    store = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in store.repo:
        store.store(name=SCHEMA_NAME, node=default_config())


def _split_recipe(args: list[str]) -> tuple[Path, list[str]]:
    recipe = [a for a in args if a.startswith("recipe=")]
    if len(recipe) != 1:
        raise ConfigError("give exactly one recipe=NAME (a file in recipes/ or a path to a .yaml)")
    name = recipe[0].split("=", 1)[1]
    path = Path(name) if name.endswith((".yaml", ".yml")) else recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
        raise ConfigError(f"recipe={name}: no such recipe ({path}); known: {', '.join(known)}")
    return path.resolve(), [a for a in args if not a.startswith("recipe=")]


def _one_line(exc: Exception) -> str:
    """Hydra/OmegaConf errors span several lines (the reason is often in ``__cause__``, the key in a
    ``full_key:`` line); keep ``<key>: <reason>``."""
    source = exc.__cause__ or exc
    lines = [ln.strip() for ln in str(source).splitlines() if ln.strip()]
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    override = re.match(r"Error merging override [+~]*([^=]+)=", str(exc))
    if full_key and override and not full_key.startswith(override.group(1)):  # a key inside a list's entry
        full_key = f"{override.group(1)}: {full_key}"
    if full_key:
        return f"{full_key}: {lines[0]}"
    return "; ".join(lines[:2]) or type(exc).__name__


def _unknown_keys(cfg: DictConfig, schema: DictConfig, prefix: str = "") -> list[str]:
    """Keys in ``cfg`` that the schema does not have (``+key=`` slips them past Hydra)."""
    found = []
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if key not in schema.keys():
            found.append(full)
            continue
        sub, ref = cfg._get_node(key), schema._get_node(key)
        if isinstance(sub, DictConfig) and isinstance(ref, DictConfig):
            found += _unknown_keys(sub, ref, f"{full}.")
    return found


def load_config(args: list[str]) -> MegarlConfig:
    """Compose ``recipe=NAME`` plus overrides into the run config: resolved, its paths absolute, validated,
    and frozen (a :class:`MegarlConfig` of the schema's dataclasses; its topology is computed once, by
    :attr:`MegarlConfig.topology`)."""
    path, overrides = _split_recipe(args)
    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
            cfg = compose(config_name=path.stem, overrides=overrides)
    except Exception as exc:  # Hydra raises several types; all mean "this input is wrong"
        raise ConfigError(_one_line(exc)) from exc
    finally:
        GlobalHydra.instance().clear()
    extra = _unknown_keys(cfg, _schema_keys())
    if extra:
        raise ConfigError(f"{extra[0]}: not a megarl config key (misspelt, or added with '+')")
    try:
        OmegaConf.resolve(cfg)
    except Exception as exc:
        raise ConfigError(_one_line(exc)) from exc
    if cfg.sync.transport == "auto":  # the weights' way into the engines follows the placement
        cfg.sync.transport = "tensor" if cfg.placement == "colocated" else "distributed"
    if _overridden(overrides, "model.hf_path") and not _overridden(overrides, "model.make_tiny_if_missing"):
        cfg.model.make_tiny_if_missing = False  # the recipe's build-if-missing is for the recipe's own path
    make_paths_absolute(cfg)
    _check_set(cfg)
    typed = OmegaConf.to_object(cfg)
    validate(typed)
    return typed


def _check_set(cfg: DictConfig) -> None:
    """ConfigError naming the first key a recipe must set and left unset (``???``)."""
    for i, entry in enumerate(cfg.task.role_engines):
        if OmegaConf.is_missing(entry, "role"):
            fail(f"task.role_engines[{i}].role", "missing: name the role its engines serve")
    unset = sorted(OmegaConf.missing_keys(cfg))
    if unset:
        fail(unset[0], "missing: set it in the recipe or as an override")


def _overridden(overrides: list[str], key: str) -> bool:
    """Whether a command-line override sets ``key``."""
    return any(o.lstrip("+").split("=", 1)[0] == key for o in overrides)


# The keys that hold a file or directory of the run. Processes on other nodes read them (trainer ranks and
# engine servers start in their Ray node's working directory, not the driver's): each is made absolute
# against the loading process's working directory.
PATH_KEYS = ("model.hf_path", "critic.hf_path", "warmup.save_hf_path", "teacher.hf_path", "reward.judge.hf_path",
             "task.path", "logging.run_dir", "sync.work_dir")


def make_paths_absolute(cfg: DictConfig, cwd: Path | None = None) -> None:
    """Every path of ``cfg`` (:data:`PATH_KEYS`, and each ``task.role_engines[i].hf_path``) that is set made
    absolute against ``cwd`` (default: this process's working directory), in place."""
    cwd = Path.cwd() if cwd is None else cwd
    keys = [*PATH_KEYS, *(f"task.role_engines.{i}.hf_path" for i in range(len(cfg.task.role_engines)))]
    for key in keys:
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            OmegaConf.update(cfg, key, str(cwd / value), merge=False)

