"""A config field is declared once: the sections components own are the schema's nodes, and a settings
class built from a section extends that section's class rather than copying its fields."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from megarl.algos.settings import AlgorithmConfig
from megarl.config.schema import MegarlConfig
from megarl.models.lora import LoraConfig
from megarl.sync.settings import SyncConfig, SyncSettings
from megarl.trainer.optimizer import OptimizerSettings
from megarl.trainer.settings import CriticConfig, OptimizerConfig, TrainerConfig, WarmupConfig
from megarl.trainer.warmup import WarmupJob

pytestmark = pytest.mark.unit

# settings class -> the schema node whose fields it carries
DERIVED = {SyncSettings: SyncConfig, OptimizerSettings: OptimizerConfig, TrainerConfig: OptimizerConfig,
           WarmupJob: WarmupConfig}


def _declared(cls) -> set[str]:
    """The fields ``cls``'s own body declares (not inherited)."""
    return set(cls.__dict__.get("__annotations__", {}))


def test_owned_sections_are_the_components_classes():
    hints = typing.get_type_hints(MegarlConfig)
    owned = {"lora": (LoraConfig, "megarl.models.lora"), "sync": (SyncConfig, "megarl.sync.settings"),
             "algorithm": (AlgorithmConfig, "megarl.algos.settings"),
             "trainer": (TrainerConfig, "megarl.trainer.settings"),
             "critic": (CriticConfig, "megarl.trainer.settings"), "warmup": (WarmupConfig, "megarl.trainer.settings")}
    for key, (cls, module) in owned.items():
        assert hints[key] is cls and cls.__module__ == module, key


def test_settings_inherit_their_sections_fields_and_declare_none_again():
    for settings, section in DERIVED.items():
        assert issubclass(settings, section), settings
        names = {f.name for f in dataclasses.fields(section)}
        assert names <= {f.name for f in dataclasses.fields(settings)}, settings
        assert not _declared(settings) & names, (settings, _declared(settings) & names)
        for f in dataclasses.fields(section):  # the same default and bounds: the same field object's
            assert settings.__dataclass_fields__[f.name].metadata == f.metadata


def test_settings_from_a_loaded_config_carry_its_values():
    from megarl.config import load_config
    from megarl.config.components import optimizer_settings

    cfg = load_config(["recipe=tiny_moe_cpu", "trainer.adam_beta1=0.25", "sync.bucket_mb=8", "steps=7"])
    opt = optimizer_settings(cfg, updates_per_step=3)
    assert (opt.lr, opt.adam_beta1, opt.lr_decay_steps, opt.dtype) == (5e-4, 0.25, 21, "float32")
    sync = SyncSettings.from_config(cfg.sync, engine_tp=2)
    assert dataclasses.asdict(sync) == {**{f.name: getattr(cfg.sync, f.name) for f in dataclasses.fields(SyncConfig)},
                                        "engine_tp": 2}


# Dataclasses that repeat a section's field names and are not its settings: the planner's report of the
# adapters it sized (printed beside their sizes); the trainer's layout, a frozen value the trainer ranks
# and process groups share (the ``parallel`` section's keys and two more; a frozen class cannot be the base
# of a schema node Hydra overrides).
NOT_SETTINGS = {("LoraPlan", "LoraConfig"), ("Layout", "ParallelConfig")}


def test_no_schema_section_is_mirrored_by_another_dataclass():
    """No dataclass of megarl outside the schema declares (in its own body) most of a section's fields again."""
    import importlib
    import pkgutil

    import megarl

    sections = [t for t in typing.get_type_hints(MegarlConfig).values() if dataclasses.is_dataclass(t)]
    mirrors = []
    for info in pkgutil.walk_packages(megarl.__path__, "megarl."):
        if info.name.startswith(("megarl.config", "megarl.engine_process", "megarl.platform.sglang")) or \
                info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if not (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == info.name):
                continue
            for section in sections:
                names = {f.name for f in dataclasses.fields(section)}
                if obj not in section.__mro__ and len(_declared(obj) & names) > max(2, len(names) // 2):
                    mirrors.append((obj.__qualname__, section.__name__, sorted(_declared(obj) & names)))
    assert {(name, section) for name, section, _ in mirrors} == NOT_SETTINGS, mirrors


def test_load_config_returns_the_frozen_typed_config():
    from megarl.config import load_config

    cfg = load_config(["recipe=tiny_moe_cpu", "algorithm.clip_high=0.3", "rollout.num_engines=2"])
    assert type(cfg) is MegarlConfig and type(cfg.algorithm) is AlgorithmConfig
    assert type(cfg.trainer) is TrainerConfig and type(cfg.sync) is SyncConfig
    assert (cfg.algorithm.clip_high, cfg.rollout.num_engines) == (0.3, 2)
    assert cfg.algorithm.loss_scale_factor == cfg.rollout.max_new_tokens  # interpolations resolved
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.algorithm.clip_high = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 1


def test_the_run_topology_is_built_once_a_run(monkeypatch):
    """Loading (its checks), the planner and the start-up's readers share the config's one topology."""
    from megarl.config import load_config
    from megarl.config.topology import RunTopology
    from megarl.planner.layout import plan_layout
    from megarl.planner.placement import place

    built = []
    original = RunTopology.from_config.__func__
    monkeypatch.setattr(RunTopology, "from_config", classmethod(lambda cls, c: built.append(c) or original(cls, c)))
    cfg = load_config(["recipe=qwen3_30b_a3b"])
    plan_layout(cfg)
    place(cfg.topology)
    assert cfg.topology is cfg.topology and len(built) == 1 and built[0] is cfg


def test_only_the_run_config_builds_the_topology():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    callers = []
    for path in sorted((root / "megarl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "from_config" and \
                    isinstance(node.value, ast.Name) and node.value.id == "RunTopology":
                callers.append(path.relative_to(root).as_posix())
    assert callers == ["megarl/config/schema.py"]
