"""Recipes compose onto the typed schema; every bad input exits non-zero with one line naming the key."""
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from megarl.config import ConfigError, load_config
from megarl.train import main


def test_tiny_recipe_composes_with_overrides():
    cfg = load_config(["recipe=tiny_moe_cpu", "trainer.lr=3e-4", "parallel.world_size=2", "parallel.ep=2"])
    assert cfg.trainer.lr == 3e-4 and cfg.parallel.ep == 2
    assert cfg.logging.run_dir == "runs/tiny_moe_cpu"  # interpolation resolved


def test_cfg_job_prints_the_resolved_config():
    result = subprocess.run([sys.executable, "-m", "megarl.train", "recipe=tiny_moe_cpu", "--cfg", "job",
                             "warmup.steps=7"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.create(result.stdout)
    assert printed.warmup.steps == 7 and printed.model.arch.num_experts == 8


BAD_INPUTS = [
    (["trainer.lrr=1"], "trainer.lrr", "not in"),
    (["trainer.lr=fast"], "trainer.lr", "could not be converted"),
    (["+trainer.new_key=1"], "trainer.new_key", "not a megarl config key"),
    (["+brand_new=1"], "brand_new", "not a megarl config key"),
    (["parallel.world_size=3", "parallel.tp=2", "parallel.sequence_parallel=true"], "parallel.world_size", "not divisible by tp*pp*cp"),
    (["parallel.world_size=3", "parallel.ep=3"], "parallel.ep", "8 experts are not divisible by ep=3"),
    (["parallel.world_size=2", "parallel.tp=2"], "parallel.sequence_parallel", "requires sequence_parallel"),
    (["parallel.world_size=4", "parallel.pp=4"], "parallel.pp", "2 layers do not split"),
    (["mode=fast"], "mode", "not one of"),
    (["placement=colocated"], "placement", "not built yet"),
    (["rollout.engine_tp=2"], "rollout.engine_tp", "not passed to SGLang yet"),
    (["algorithm.kl_coef=0.1"], "algorithm.kl_coef", "needs a reference model"),
    (["sync.transport=carrier_pigeon"], "sync.transport", "not one of distributed, tensor, disk"),
    (["buffer.partial_rollout=later"], "buffer.partial_rollout", "continue or abort_resubmit"),
    (["trainer.recompute=full"], "trainer.recompute", "not applied by the trainer yet"),
    (["task.name=jsonl"], "task.path", "needs the dataset file"),
    (["task.name=csv"], "task.name", "is not one of arithmetic, jsonl, parquet"),
    (["reward.type=remote"], "reward.url", "needs reward.url"),
    (["rollout.top_k=0"], "rollout.top_k", "finite top_k"),
]


@pytest.mark.parametrize("overrides, key, why", BAD_INPUTS, ids=[b[1] for b in BAD_INPUTS])
def test_bad_input_exits_with_one_line_naming_the_key(overrides, key, why, capsys):
    assert main(["recipe=tiny_moe_cpu", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"megarl: config error: {key}: "), err
    assert why in err


def test_unknown_recipe_lists_the_known_ones(capsys):
    assert main(["recipe=no_such_recipe"]) == 2
    err = capsys.readouterr().err
    assert "no_such_recipe" in err and "tiny_moe_cpu" in err


def test_recipe_arch_must_agree_with_the_checkpoint(tiny_checkpoint):
    with pytest.raises(ConfigError, match="model.arch.num_layers: the recipe says 4"):
        load_config(["recipe=tiny_moe_cpu", f"model.hf_path={tiny_checkpoint}", "model.arch.num_layers=4"])


def test_bad_input_exits_non_zero_from_the_command_line():
    result = subprocess.run([sys.executable, "-m", "megarl.train", "recipe=tiny_moe_cpu", "parallel.tp=two"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "megarl: config error: parallel.tp: Value 'two' of type 'str' could not be converted to Integer"
