"""Typed configuration: the Hydra schema (``schema``), recipe loading (``load``), the cross-section rules
(``validate``), the run's topology (``topology``), what a run reads and what this machine cannot run,
checked before it starts (``inputs``, ``platform_rules``), each component's settings composed from the run
config (``components``), and the config error type (``errors``)."""
from megarl.config.errors import ConfigError
from megarl.config.load import default_config, load_config, recipes_dir
from megarl.config.schema import MegarlConfig

__all__ = ["ConfigError", "MegarlConfig", "default_config", "load_config", "recipes_dir"]
