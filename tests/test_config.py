"""Recipes compose onto the typed schema; every bad input exits non-zero with one line naming the key."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from megarl.config import ConfigError, load_config
from megarl.config.components import optimizer_settings
from megarl.config.inputs import check_inputs
from megarl.train import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_tiny_recipe_composes_with_overrides():
    cfg = load_config(["recipe=tiny_moe_cpu", "trainer.lr=3e-4", "parallel.world_size=2", "parallel.ep=2"])
    assert cfg.trainer.lr == 3e-4 and cfg.parallel.ep == 2
    assert cfg.logging.run_dir == str(Path.cwd() / "runs/tiny_moe_cpu")  # interpolation resolved, made absolute


@pytest.mark.processes
def test_cfg_job_prints_the_resolved_config():
    result = subprocess.run([sys.executable, "-m", "megarl.train", "recipe=tiny_moe_cpu", "--cfg", "job",
                             "warmup.steps=7"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.create(result.stdout)
    assert printed.warmup.steps == 7 and printed.model.arch.num_experts == 8


AGENT, ROLES = "task.agent=agent_examples:solver_and_verifier", "task.roles=[solver,verifier]"
BAD_INPUTS = [
    (["trainer.lrr=1"], "trainer.lrr", "not in"),
    (["trainer.lr=fast"], "trainer.lr", "could not be converted"),
    (["+trainer.new_key=1"], "trainer.new_key", "not a megarl config key"),
    (["+brand_new=1"], "brand_new", "not a megarl config key"),
    (["parallel.world_size=3", "parallel.tp=2", "parallel.sequence_parallel=true"], "parallel.world_size",
     "not divisible by tp*pp*cp"),
    (["parallel.world_size=3", "parallel.ep=3"], "parallel.ep", "8 experts are not divisible by ep=3"),
    (["parallel.world_size=2", "parallel.tp=2"], "parallel.sequence_parallel", "requires sequence_parallel"),
    (["parallel.world_size=4", "parallel.pp=4"], "parallel.pp", "2 layers do not split"),
    (["mode=fast"], "mode", "not one of"),
    (["placement=colocated", "sync.transport=distributed"], "sync.transport",
     "colocated placement needs sync.transport=tensor"),
    (["rollout.engine_tp=2", "sync.transport=tensor"], "sync.transport",
     "into an engine of several ranks fails on CPU"),
    (["rollout.engine_dp_attention=true", "rollout.engine_tp=2"], "rollout.engine_dp_attention",
     "cannot run DP attention"),
    (["rollout.engine_dp_attention=true"], "rollout.engine_tp", "runs one attention replica per rank and needs "
     "engine_tp > 1"),
    (["rollout.mem_fraction_static=1.0"], "rollout.mem_fraction_static", "must be in (0, 1), got 1.0"),
    (["teacher.engine_tp=2"], "teacher.engine_tp", "sets the ranks of the teacher's engine: set teacher.hf_path too"),
    ([AGENT, ROLES, "task.role_engines=[{role:verifier,engines:[0],engine_tp:2}]"], "task.role_engines[0].engine_tp",
     "'verifier' is served by the policy's engines, whose ranks are rollout.engine_tp"),
    (["trainer.optimizer_cpu_offload=true"], "trainer.optimizer_cpu_offload",
     "with model.dtype=float32 there are none"),
    (["trainer.optimizer_cpu_offload=true", "model.dtype=bfloat16", "trainer.use_distributed_optimizer=false"],
     "trainer.optimizer_cpu_offload", "set trainer.use_distributed_optimizer=true"),
    (["trainer.optimizer_cpu_offload=true", "model.dtype=bfloat16"], "trainer.optimizer_cpu_offload",
     "without a GPU the state is in host memory already"),
    (["rollout.engine_tp=3"], "rollout.engine_tp", "3"),
    (["parallel.world_size=2", "parallel.cp=2"], "parallel.cp", "needs transformer-engine's attention"),
    (["sync.transport=carrier_pigeon"], "sync.transport", "not one of auto, distributed, tensor, disk"),
    (["buffer.partial_rollout=later"], "buffer.partial_rollout", "'later' is not one of continue, abort_resubmit"),
    (["buffer.partial_rollout=in_place", "placement=colocated"], "buffer.partial_rollout",
     "colocated placement holds none"),
    (["algorithm.advantage=ppo"], "algorithm.advantage", "'ppo' is not one of grpo, dr_grpo, rloo, reinforce_pp"),
    (["algorithm.policy_loss=ppoo"], "algorithm.policy_loss", "'ppoo' is not one of ppo, gspo, cispo"),
    (["algorithm.loss_agg=sum"], "algorithm.loss_agg", "is not one of token_mean, seq_mean_token_mean"),
    (["algorithm.kl_type=k4"], "algorithm.kl_type", "'k4' is not one of k1, k2, k3, low_var_kl, k1_is, k2_is, k3_is"),
    (["algorithm.off_policy_correction=is"], "algorithm.off_policy_correction", "'is' is not one of none, tis, mis"),
    (["algorithm.off_policy_level=batch"], "algorithm.off_policy_level", "'batch' is not one of token, sequence"),
    (["algorithm.dual_clip=3", "algorithm.policy_loss=gspo"], "algorithm.dual_clip", "ppo policy loss only"),
    (["algorithm.is_threshold=0.5"], "algorithm.is_threshold", "must be >= 1"),
    (["algorithm.is_threshold_low=1.5"], "algorithm.is_threshold_low", "must be in [0, 1]"),
    (["algorithm.off_policy_veto_threshold=0"], "algorithm.off_policy_veto_threshold", "must be in (0, 1]"),
    (["algorithm.off_policy_veto_threshold_high=0.5"], "algorithm.off_policy_veto_threshold_high", "must be >= 1"),
    (["algorithm.old_policy=engine"], "algorithm.old_policy", "'engine' is not one of recompute, rollout"),
    (["algorithm.old_policy=rollout", "algorithm.off_policy_correction=tis"], "algorithm.off_policy_correction",
     "the PPO ratio to the rollout policy is the correction"),
    (['algorithm.off_policy_rejection="token_k1,seq_max_k1"', "algorithm.off_policy_rejection_threshold=2"],
     "algorithm.off_policy_rejection", "'seq_max_k1' is not one of token_k1"),
    (["algorithm.off_policy_rejection=seq_max_k3"], "algorithm.off_policy_rejection_threshold",
     "need a threshold"),
    (['algorithm.off_policy_rejection="token_k1,seq_max_k3"', 'algorithm.off_policy_rejection_threshold="2,3,4"'],
     "algorithm.off_policy_rejection_threshold", "3 thresholds for 2 rejection criteria"),
    (["algorithm.off_policy_rejection=seq_max_k3", 'algorithm.off_policy_rejection_threshold="0.5_2"'],
     "algorithm.off_policy_rejection_threshold", "must be one number (an upper bound)"),
    (["algorithm.off_policy_rejection_threshold=2"], "algorithm.off_policy_rejection_threshold",
     "set it too"),
    (["algorithm.off_policy_rejection=token_k1", "algorithm.off_policy_rejection_threshold=0.5_2"],  # Hydra: 0.52
     "algorithm.off_policy_rejection_threshold", "needs 0 < lower <= upper"),
    (["algorithm.sapo_tau_neg=0"], "algorithm.sapo_tau_neg", "must be > 0"),
    (["algorithm.clip_absolute=true"], "algorithm.clip_absolute", "cispo policy loss only"),
    (["algorithm.policy_loss=cispo", "algorithm.clip_absolute=true", "algorithm.clip_high=0.5"], "algorithm.clip_low",
     "absolute bounds need 0 <= clip_low <= 1 <= clip_high"),
    (["algorithm.loss_scale_factor=0"], "algorithm.loss_scale_factor", "must be >= 1"),
    (["algorithm.policy_loss=clip_cov", "algorithm.clip_cov_lb=5"], "algorithm.clip_cov_lb",
     "must be below clip_cov_ub, got 5.0 and 5.0"),
    (["algorithm.clip_cov_ratio=0"], "algorithm.clip_cov_ratio", "must be in (0, 1]"),
    (["algorithm.dppo_type=binary_js"], "algorithm.dppo_type", "'binary_js' is not one of binary_tv, binary_kl"),
    (["algorithm.dppo_delta_low=-0.1"], "algorithm.dppo_delta_low", "must be >= 0"),
    (["algorithm.kl_ctrl=adaptive", "algorithm.kl_coef=0.01"], "algorithm.kl_ctrl",
     "set algorithm.kl_in_reward=true and kl_coef > 0"),
    (["algorithm.kl_ctrl=adaptive", "algorithm.kl_in_reward=true"], "algorithm.kl_ctrl",
     "set algorithm.kl_in_reward=true and kl_coef > 0"),
    (["algorithm.kl_horizon=0"], "algorithm.kl_horizon", "must be > 0"),
    (["algorithm.advantage=reinforce_plus_plus", "task.env=calculator"], "algorithm.advantage",
     "cut its reward off"),
    (["algorithm.advantage=reinforce_plus_plus", "algorithm.off_policy_mask_kl=0.1"], "algorithm.off_policy_mask_kl",
     "reinforce_plus_plus gives per-token ones"),
    (["algorithm.score_centering=exact", "rollout.keep_sampling_mask=false"], "algorithm.score_centering",
     "set rollout.keep_sampling_mask=true"),
    (["algorithm.score_centering=tail", "task.env=calculator"], "algorithm.score_centering",
     "do not carry the engine's support log-probs"),
    (["parallel.world_size=2", "parallel.cp=2", "algorithm.score_centering=exact"], "algorithm.score_centering",
     "not gathered over context-parallel ranks (parallel.cp=2)"),
    (["algorithm.score_centering=exact", "algorithm.policy_loss=kl_cov"], "algorithm.score_centering",
     "kl_cov's per-token |logp - logp_old| penalty"),
    (["algorithm.score_centering=exactly"], "algorithm.score_centering", "'exactly' is not one of none, exact, tail"),
    (["algorithm.score_centering_head=0"], "algorithm.score_centering_head", "must be >= 1"),
    (["rollout.top_p=0"], "rollout.top_p", "must be in (0, 1]"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens", "must be >= 1"),
    (["reward.type=bleu"], "reward.type", "'bleu' is not one of arithmetic, exact_match, math, remote, function"),
    (["reward.type=remote", "reward.url=localhost:8000"], "reward.url", "is not an http(s) URL"),
    (["reward.type=function", "reward.path=json.no_such_fn"], "reward.path", "AttributeError"),
    (["reward.type=function", "reward.path=nope.mod.fn"], "reward.path", "No module named 'nope'"),
    (["task.name=jsonl", "task.path=/nope.jsonl", "warmup.steps=0", "reward.type=math"], "task.path",
     "/nope.jsonl does not exist"),
    (["task.name=jsonl"], "task.path", "needs the dataset file"),
    (["task.name=jsonl", "task.path=/nope.jsonl", "warmup.steps=0"], "reward.type",
     "the arithmetic reward scores the demo's sums (exactly the answer, then end of sequence), not task.name=jsonl"),
    (["task.name=jsonl", "task.path=/nope.jsonl", "reward.type=math"], "warmup.steps",
     "the warm-up trains on synthetic arithmetic problems (the tiny demos' start), not on task.name=jsonl's rows"),
    (["mode=warmup", "warmup.steps=0"], "warmup.steps", "mode=warmup runs the warm-up alone"),
    (["task.chat_template=true"], "task.chat_template", "renders the prompts of a single-turn dataset task"),
    (["warmup.steps=-1"], "warmup.steps", "must be >= 0"),
    (["task.name=csv"], "task.name", "is not one of arithmetic, jsonl, parquet"),
    (["reward.type=remote"], "reward.url", "needs reward.url"),
    (["rollout.top_k=0"], "rollout.top_k", "must be >= 1 or -1, got 0"),
    (["rollout.top_k=-1"], "rollout.top_k", "finite top_k"),
    (["task.agent_workers=2"], "task.agent_workers", "agent workers run an agent program's episodes: set task.agent"),
    ([AGENT, "task.agent_workers=-1"], "task.agent_workers", "must be >= 0"),
    ([AGENT, "task.role_engines=[{role:solver,engines:[0]}]"], "task.role_engines",
     "places the roles of task.roles on engines: set task.roles"),
    ([AGENT, ROLES, "task.role_engines=[{role:critic,engines:[0]}]"], "task.role_engines[0].role",
     "'critic' is not one of task.roles ['solver', 'verifier']"),
    ([AGENT, ROLES, "task.role_engines=[{role:solver,engines:[0]},{role:solver,engines:[0]}]"],
     "task.role_engines[0].role", "'solver' is placed more than once"),
    ([AGENT, ROLES, "rollout.num_engines=2", "task.role_engines=[{role:verifier,engines:[2]}]"],
     "task.role_engines[0].engines", "must be distinct engine indices in [0, 2) (rollout.num_engines=2), "
                                     "at least one; got [2]"),
    ([AGENT, ROLES, "task.role_engines=[{role:verifier}]"], "task.role_engines[0].engines", "at least one; got []"),
    ([AGENT, ROLES, "task.role_engines=[{engines:[0]}]"], "task.role_engines[0].role", "missing: name the role"),
    ([AGENT, ROLES, "task.role_engines=[{role:verifier,engines:[0],hf_path:/ckpt}]"], "task.role_engines[0]",
     "'verifier' is served by the frozen model hf_path=/ckpt or by the policy's engines [0], not both"),
    ([AGENT, ROLES, "task.role_engines=[{role:solver,hf_path:/a},{role:verifier,hf_path:/b}]"], "task.role_engines",
     "every role of task.roles ['solver', 'verifier'] is a frozen model: no role would be trained"),
]


@pytest.mark.unit
@pytest.mark.parametrize("overrides, key, why", BAD_INPUTS, ids=[b[1] for b in BAD_INPUTS])
def test_bad_input_exits_with_one_line_naming_the_key(overrides, key, why, capsys):
    assert main(["recipe=tiny_moe_cpu", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"megarl: config error: {key}: "), err
    assert why in err


@pytest.mark.unit
def test_unknown_recipe_lists_the_known_ones(capsys):
    assert main(["recipe=no_such_recipe"]) == 2
    err = capsys.readouterr().err
    assert "no_such_recipe" in err and "tiny_moe_cpu" in err


@pytest.mark.unit
def test_recipe_arch_must_agree_with_the_checkpoint(tiny_checkpoint):
    with pytest.raises(ConfigError, match="model.arch.num_layers: the recipe says 4"):
        load_config(["recipe=tiny_moe_cpu", f"model.hf_path={tiny_checkpoint}", "model.arch.num_layers=4"])


@pytest.mark.processes
def test_bad_input_exits_non_zero_from_the_command_line():
    result = subprocess.run([sys.executable, "-m", "megarl.train", "recipe=tiny_moe_cpu", "parallel.tp=two"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == ("megarl: config error: parallel.tp: "
                                     "Value 'two' of type 'str' could not be converted to Integer")


# --- names come from the registries of the code that uses them ------------------------------------

def _companions(key: str, name: str, tmp_path) -> list[str]:
    """The overrides a name needs besides itself to load (a dataset file, a URL, a function)."""
    if key == "task.name" and name in ("jsonl", "parquet"):
        import datasets

        path = tmp_path / f"rows.{name}"
        rows = datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}])
        rows.to_json(str(path)) if name == "jsonl" else rows.to_parquet(str(path))
        return [f"task.path={path}", "warmup.steps=0", "reward.type=exact_match"]  # both: arithmetic only
    if key == "reward.type":
        return {"remote": ["reward.url=http://localhost:8000/reward"],
                "function": ["reward.path=megarl.tasks.rewards.exact_match_reward"]}.get(name, [])
    if (key, name) == ("algorithm.advantage", "opd"):  # distils from a teacher (checked at load, not read)
        return [f"teacher.hf_path={tmp_path / 'teacher'}", "algorithm.opd_coef=1.0"]
    if (key, name) == ("algorithm.advantage", "gae"):  # GAE over a critic's values
        return ["critic.enabled=true"]
    if (key, name) == ("algorithm.old_policy", "rollout"):  # the PPO ratio is the correction: no IS weight on top
        return ["algorithm.off_policy_correction=none"]
    if (key, name) == ("algorithm.kl_ctrl", "adaptive"):  # it moves the coefficient of the KL in the reward
        return ["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.01"]
    return []


@pytest.mark.unit
def test_the_big_recipes_run_rl_from_their_checkpoint():
    """Recipes without a ``mode`` or ``warmup`` section (the big models') run RL, async, from
    ``model.hf_path``: the warm-up is the tiny demos' start on arithmetic problems (it was the default,
    and ``recipe=qwen3_235b_a22b`` ran 60 arithmetic warm-up steps on the model and stopped)."""
    big = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if not p.stem.startswith("tiny_"))
    assert len(big) >= 5, big
    for recipe in big:
        cfg = load_config([f"recipe={recipe}"])
        assert (cfg.mode, cfg.warmup.steps) == ("async", 0), recipe


@pytest.mark.unit
def test_transport_auto_follows_the_placement():
    assert load_config(["recipe=tiny_moe_cpu"]).sync.transport == "distributed"
    assert load_config(["recipe=tiny_moe_cpu", "placement=colocated"]).sync.transport == "tensor"
    assert load_config(["recipe=tiny_moe_cpu", "sync.transport=disk"]).sync.transport == "disk"


def _registries() -> dict[str, tuple]:
    """Config key -> the names it may take, as the schema's fields declare them (section by section)."""
    import dataclasses
    import typing

    from megarl.config.schema import MegarlConfig
    from megarl.fields import bounds_of

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                yield from walk(hint, f"{prefix}{f.name}.")
            elif bounds_of(f) is not None and bounds_of(f).choices:
                yield f"{prefix}{f.name}", bounds_of(f).choices

    return dict(walk(MegarlConfig, ""))


@pytest.mark.unit
def test_every_registered_name_loads_and_the_defaults_are_registered(tmp_path):
    from megarl.config.load import default_config

    defaults = default_config()
    registries = _registries()
    assert {"algorithm.kl_type", "task.name", "lora.sync", "sync.transport", "mode"} <= set(registries)
    for key, names in registries.items():
        default = OmegaConf.select(defaults, key)
        # sync.transport "auto" is resolved by placement at load, before the names are checked
        assert default in names or default is None, key  # None: an optional key left unset
        for name in names:
            load_config(["recipe=tiny_moe_cpu", f"{key}={name}", *_companions(key, name, tmp_path)])


@pytest.mark.unit
def test_every_name_valued_algorithm_key_has_a_registry():
    """A misspelt algorithm name fails at load with the valid names only if its field declares them."""
    import dataclasses

    from megarl.algos.settings import AlgorithmConfig

    names = [f.name for f in dataclasses.fields(AlgorithmConfig) if f.type in ("str", str)]
    assert names and all(f"algorithm.{name}" in _registries() for name in names), names


# --- inputs an RL run reads, checked by the driver before it starts anything ----------------------

def loaded(args: list[str]):
    """``load_config`` plus the driver's input checks."""
    cfg = load_config(args)
    check_inputs(cfg)
    return cfg


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.unit
def test_dataset_fields_are_checked_from_the_first_rows(tmp_path):
    dataset = ["task.name=jsonl", "warmup.steps=0", "reward.type=exact_match"]
    load_config(["recipe=tiny_moe_cpu", *dataset, "task.path=/nope.jsonl"])  # the planner: files are elsewhere
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"question": "a"}, {"question": "b", "solution": 2}])
    base = ["recipe=tiny_moe_cpu", *dataset, f"task.path={path}"]
    cfg = loaded([*base, "task.prompt_key=question", "task.answer_key=solution"])  # fields of any first row
    assert cfg.task.path == str(path)
    loaded([*base, "task.prompt_key=question", "task.answer_key="])  # no answers
    with pytest.raises(ConfigError, match=r"^task.prompt_key: 'prompt' is not a field of .*rows.jsonl; "
                                          r"its rows have question, solution$"):
        loaded(base)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="^task.path: .*empty.jsonl has no rows"):
        loaded(["recipe=tiny_moe_cpu", *dataset, f"task.path={tmp_path / 'empty.jsonl'}"])
    (tmp_path / "array.json").write_text(json.dumps([{"question": "a"}], indent=1))  # not JSON Lines:
    loaded(["recipe=tiny_moe_cpu", *dataset, f"task.path={tmp_path / 'array.json'}"])  # read later


@pytest.mark.unit
def test_every_line_of_a_jsonl_dataset_is_read_and_a_bad_one_named(tmp_path):
    dataset = ["recipe=tiny_moe_cpu", "task.name=jsonl", "warmup.steps=0", "reward.type=exact_match"]
    rows = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(200)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(rows[:150] + ['{"prompt": "x"'] + rows[150:]) + "\n")  # past the first 100 rows
    with pytest.raises(ConfigError, match=r"^task.path: .*rows.jsonl line 151 is not valid JSON \(Expecting ',' "
                                          r"delimiter at column 15\): '\{\"prompt\": \"x\"'$"):
        loaded([*dataset, f"task.path={path}"])
    path.write_text("\n".join([rows[0], "[1, 2]"]) + "\n")
    with pytest.raises(ConfigError, match=r"^task.path: .*rows.jsonl line 2 is a JSON list, not an object of fields"):
        loaded([*dataset, f"task.path={path}"])
    path.write_text('{"prompt": "a",\n "answer": "b"}\n')  # one JSON document over two lines: the full read decides
    loaded([*dataset, f"task.path={path}"])


@pytest.mark.unit
def test_the_recipes_tiny_model_is_built_at_its_own_path_only(tmp_path):
    assert load_config(["recipe=tiny_moe_cpu"]).model.make_tiny_if_missing
    elsewhere = f"model.hf_path={tmp_path / 'mistyped'}"
    assert not load_config(["recipe=tiny_moe_cpu", elsewhere]).model.make_tiny_if_missing
    assert load_config(["recipe=tiny_moe_cpu", elsewhere, "model.make_tiny_if_missing=true"]).model.make_tiny_if_missing


@pytest.mark.unit
def test_a_checkpoint_config_that_is_not_a_json_object_is_named(tmp_path):
    (tmp_path / "config.json").write_text('["qwen3_moe"]')
    with pytest.raises(ConfigError, match=r"^teacher.hf_path: .*config.json holds a JSON list, not an object"):
        load_config(["recipe=tiny_moe_cpu", f"teacher.hf_path={tmp_path}"])
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(ConfigError, match=r"^model.hf_path: .*config.json is not UTF-8 text"):
        load_config(["recipe=tiny_moe_cpu", f"model.hf_path={tmp_path}"])


@pytest.mark.unit
def test_a_checkpoint_without_its_weights_or_tokenizer_is_named(tmp_path):
    from megarl.config.inputs import checkpoint_files_problem

    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_files_problem(tmp_path) == (f"{tmp_path} holds no weights (no model.safetensors, nor a "
                                                  "model.safetensors.index.json)")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}))
    (tmp_path / "model-1.safetensors").write_bytes(b"")
    assert checkpoint_files_problem(tmp_path) == (f"{tmp_path} lacks 1 of the 2 weight files its index lists "
                                                  "(model-2.safetensors): an unfinished download or copy?")
    (tmp_path / "model-2.safetensors").write_bytes(b"")
    assert checkpoint_files_problem(tmp_path) == (f"{tmp_path} holds no tokenizer (none of tokenizer.json, "
                                                  "tokenizer_config.json, tokenizer.model)")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert checkpoint_files_problem(tmp_path) is None
    index.write_text("{")
    assert checkpoint_files_problem(tmp_path).startswith(f"{index} is not a safetensors index (JSONDecodeError: ")
    index.write_text("[]")
    with pytest.raises(ConfigError, match=r"^teacher.hf_path: .* is not a safetensors index \(TypeError"):
        loaded(["recipe=tiny_moe_cpu", f"teacher.hf_path={tmp_path}", "algorithm.opd_coef=1.0"])


@pytest.mark.unit
def test_a_chat_template_is_asked_of_a_tokenizer_that_has_one(tiny_checkpoint, tmp_path):
    import shutil

    path = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}])
    plain = tmp_path / "plain"
    shutil.copytree(tiny_checkpoint, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    base = ["recipe=tiny_moe_cpu", "task.name=jsonl", "warmup.steps=0", "reward.type=exact_match",
            f"task.path={path}", "task.chat_template=true"]
    loaded([*base, f"model.hf_path={tiny_checkpoint}"])
    with pytest.raises(ConfigError, match=r"^task.chat_template: the tokenizer saved with .*plain has no chat"):
        loaded([*base, f"model.hf_path={plain}"])


@pytest.mark.unit
def test_a_frozen_roles_model_has_the_policys_tokenizer(tiny_checkpoint, tmp_path):
    """The gateway tokenizes a frozen role's calls with the policy's tokenizer and chat template."""
    import shutil

    other = tmp_path / "other_template"
    shutil.copytree(tiny_checkpoint, other)
    (other / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    base = ["recipe=tiny_moe_cpu", "warmup.steps=0", f"model.hf_path={tiny_checkpoint}", AGENT, ROLES]
    loaded([*base, f"task.role_engines=[{{role:verifier,hf_path:'{tiny_checkpoint}'}}]"])
    with pytest.raises(ConfigError, match=r"^task.role_engines\[0\].hf_path: .*absent is not an HF checkpoint"):
        loaded([*base, f"task.role_engines=[{{role:verifier,hf_path:'{tmp_path / 'absent'}'}}]"])
    with pytest.raises(ConfigError, match=r"^task.role_engines\[0\].hf_path: the tokenizer saved with .*other_template "
                                          r"is not the policy's"):
        loaded([*base, f"task.role_engines=[{{role:verifier,hf_path:'{other}'}}]"])


@pytest.mark.unit
def test_parquet_fields_come_from_the_schema(tmp_path):
    import datasets

    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([{"question": "a", "solution": 1}]).to_parquet(str(path))
    base = ["recipe=tiny_moe_cpu", "task.name=parquet", "warmup.steps=0", "reward.type=exact_match",
            f"task.path={path}", "task.prompt_key=question"]
    loaded([*base, "task.answer_key=solution"])
    with pytest.raises(ConfigError, match="^task.answer_key: 'answer' is not a field of .*question, solution$"):
        loaded(base)
    with pytest.raises(ConfigError, match="^task.path: .* is not a readable Parquet file"):
        loaded([*base[:4], f"task.path={_write_jsonl(tmp_path / 'rows.jsonl', [{'a': 1}])}"])


@pytest.mark.unit
def test_max_new_tokens_is_checked_against_the_checkpoint_context(tiny_checkpoint, tmp_path):
    base = ["recipe=tiny_moe_cpu", f"model.hf_path={tiny_checkpoint}", f"warmup.save_hf_path={tmp_path / 'sft'}"]
    loaded([*base, "rollout.max_new_tokens=63"])
    with pytest.raises(ConfigError, match=r"^rollout.max_new_tokens: 64 leaves no room for a prompt in the model's "
                                          r"context of 64 tokens"):
        loaded([*base, "rollout.max_new_tokens=64"])
    loaded([*base, "rollout.max_new_tokens=64", "mode=warmup"])  # warm-up does not generate
    # no checkpoint yet (make_tiny_if_missing builds it at start-up): nothing to check against
    loaded(["recipe=tiny_moe_cpu", f"model.hf_path={tmp_path / 'absent'}", f"warmup.save_hf_path={tmp_path / 'no_sft'}",
            "rollout.max_new_tokens=100000"])


# --- one reader of an HF config.json ---------------------------------------------------------------

@pytest.mark.unit
def test_hf_config_of_the_tiny_checkpoint_feeds_the_served_model(tiny_checkpoint):
    from megarl.engines.types import ServedModel
    from megarl.models.hf_config import read_hf_config

    hf = read_hf_config(tiny_checkpoint)
    assert (hf.model_type, hf.num_layers, hf.hidden_size, hf.num_attention_heads, hf.num_query_groups,
            hf.head_dim, hf.moe_ffn_hidden_size, hf.num_experts, hf.moe_topk, hf.vocab_size, hf.context_length) == \
        ("qwen3_moe", 2, 64, 4, 2, 16, 128, 8, 2, 384, 64)
    assert ServedModel.from_hf_config(tiny_checkpoint) == ServedModel(vocab_size=384, num_layers=2, topk=2,
                                                                      num_experts=8, context_length=64)


@pytest.mark.unit
def test_hf_config_naming_variants_and_text_config(tmp_path):
    from megarl.engines.types import ServedModel
    from megarl.models.hf_config import HfConfig

    mixtral = HfConfig.from_dict({"model_type": "mixtral", "num_hidden_layers": 32, "num_local_experts": 8,
                                  "num_experts_per_tok": 2, "intermediate_size": 14336, "num_key_value_heads": 8})
    assert (mixtral.num_experts, mixtral.moe_ffn_hidden_size, mixtral.num_query_groups) == (8, 14336, 8)
    deepseek = HfConfig.from_dict({"model_type": "deepseek_v3", "n_routed_experts": 256, "n_shared_experts": 1,
                                   "first_k_dense_replace": 3, "num_nextn_predict_layers": 1, "kv_lora_rank": 512,
                                   "intermediate_size": 18432, "moe_intermediate_size": 2048})
    assert (deepseek.num_experts, deepseek.num_shared_experts, deepseek.first_k_dense_layers, deepseek.num_mtp_layers,
            deepseek.kv_lora_rank, deepseek.ffn_hidden_size, deepseek.moe_ffn_hidden_size) == \
        (256, 1, 3, 1, 512, 18432, 2048)
    text = {"model_type": "qwen3_vl_moe_text", "vocab_size": 100, "num_hidden_layers": 4, "num_experts": 16,
            "num_experts_per_tok": 4, "max_position_embeddings": 1024}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe", "architectures": ["VL"],
                                                      "vocab_size": 7, "text_config": text}))
    assert ServedModel.from_hf_config(tmp_path) == ServedModel(vocab_size=100, num_layers=4, topk=4, num_experts=16,
                                                               context_length=1024)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "num_hidden_layers": 2,
                                                      "max_position_embeddings": 8}))
    with pytest.raises(ValueError, match="not an MoE config: missing num_experts_per_tok"):
        ServedModel.from_hf_config(tmp_path)


# --- settings built from the config ----------------------------------------------------------------

@pytest.mark.unit
def test_engine_and_sync_settings_from_the_config(tiny_checkpoint):
    from megarl.config.topology import RunTopology, pool_engine_settings
    from megarl.platform.description import Platform
    from megarl.sync.settings import SyncSettings

    cfg = load_config(["recipe=tiny_moe_cpu", "task.seed=5", "logging.run_dir=/tmp/r", "rollout.num_engines=2"])
    topology = RunTopology.from_config(cfg)
    engine = pool_engine_settings(cfg, topology, topology.policy, Platform.cpu(), None, tiny_checkpoint)[1]
    assert (engine.model_path, engine.dtype, engine.sampling_mask_max_tokens, engine.max_total_tokens,
            engine.random_seed, engine.weight_version, engine.log_path) == \
        (tiny_checkpoint, "float32", 20, 65536, 6, 0, "/tmp/r/engine-1.log")
    sync = SyncSettings.from_config(cfg.sync)
    assert (sync.transport, sync.bucket_mb, sync.work_dir, sync.timeout_s, sync.engine_tp) == \
        ("distributed", 64, "/tmp/r/weight_sync", 600.0, 1)


@pytest.mark.unit
@pytest.mark.parametrize("overrides, tokenizer", [([], False), (["task.env=calculator"], True), ([AGENT], True)])
def test_only_a_single_turn_runs_policy_engines_start_without_their_tokenizer(tiny_checkpoint, overrides, tokenizer):
    """Multi-turn episodes send stop strings and grammars, which need the engine's tokenizer."""
    from megarl.config.topology import RunTopology, pool_engine_settings
    from megarl.engines.server import SGLangEngine
    from megarl.platform.description import Platform

    cfg = load_config(["recipe=tiny_moe_cpu", "logging.run_dir=/tmp/r", *overrides])
    topology = RunTopology.from_config(cfg)
    engine = pool_engine_settings(cfg, topology, topology.policy, Platform.cpu(), None, tiny_checkpoint)[0]
    assert engine.tokenizer is tokenizer
    assert ("--skip-tokenizer-init" in SGLangEngine(engine).command()) is not tokenizer


@pytest.mark.processes
def test_checking_a_config_loads_no_agent_runtime():
    """megarl.config checks ``task.agent`` through megarl.agents.spec: a process that only loads configs
    (every driver, tool and scenario) does not import openai or the gateway's aiohttp (~0.7 s)."""
    code = ("import sys\nimport megarl.config\n"
            "print(sorted(m for m in ('openai', 'aiohttp', 'megarl.agents.rollout') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


@pytest.mark.unit
def test_optimizer_offload_reaches_megatron_cores_optimizer():
    """``trainer.optimizer_cpu_offload`` (the 30B recipe plans its Adam state in host memory) becomes
    megatron-core's OptimizerConfig for its HybridDeviceOptimizer: every parameter's state on the host,
    reached through the precision-aware path that hands it the 16-bit shards (a run: tools/gpu_smoke.sh)."""
    from megatron.core.optimizer import OptimizerConfig

    from megarl.trainer.optimizer import cpu_offload_options

    cfg = load_config(["recipe=qwen3_30b_a3b"])
    assert cfg.trainer.optimizer_cpu_offload and optimizer_settings(cfg).optimizer_cpu_offload
    assert not optimizer_settings(load_config(["recipe=tiny_moe_cpu"])).optimizer_cpu_offload
    config = OptimizerConfig(optimizer="adam", bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                             **cpu_offload_options(True))
    assert config.optimizer_cpu_offload and config.optimizer_offload_fraction == 1.0
    assert config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    assert cpu_offload_options(False) == {}


# Read by the planner alone, by design: the machines (cluster, device memory, links) and the model's
# extremes (the longest prompt, a KV-cache size) a layout is checked against.
PLANNER_INPUTS = {"cluster.num_nodes", "cluster.host_memory_gb", "trainer.gpu_memory_gb", "trainer.reserved_memory_gb",
                  "rollout.kv_cache_gb", "rollout.max_prompt_tokens", "sync.link_gbps"}


def _schema_keys(cls=None, prefix=""):
    """Every leaf key of the config schema, dotted (``rollout.mem_fraction_static``)."""
    import dataclasses

    from megarl.config.schema import MegarlConfig

    for f in dataclasses.fields(cls or MegarlConfig):
        kind = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(kind):
            yield from _schema_keys(type(kind), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _run_sources() -> list[Path]:
    """megarl/ outside config/ (but for the run's topology, which the start-up builds its engines from),
    planner/ and plan.py: the code a run reads its config with."""
    found = []
    for path in sorted((ROOT / "megarl").rglob("*.py")):
        parts = path.relative_to(ROOT / "megarl").parts
        run_readers = (("config", "topology.py"), ("config", "components.py"))  # topology, builders' settings
        if not ((parts[0] in ("config", "planner") and parts not in run_readers) or parts == ("plan.py",)):
            found.append(path)
    return found


@pytest.mark.unit
def test_every_config_key_is_read_by_the_run_or_is_a_planner_input():
    """A key nothing but the config's checks and the planner reads is a setting users change for nothing
    (rollout.mem_fraction_static, trainer.optimizer_cpu_offload and rollout.engine were): each key is read
    from its own section (tests/config_reads.py: ``reward.judge.temperature`` where the judge's section
    is read, not wherever a ``.temperature`` appears) by the run's code (:func:`_run_sources`), or is
    interpolated into another key's default (``${run_name}``), unless it is one of the planner's inputs."""
    import re

    from config_reads import keys_read

    from megarl.config.schema import MegarlConfig

    keys = set(_schema_keys())
    assert PLANNER_INPUTS <= keys
    interpolated = set(re.findall(r"\$\{([\w.]+)\}", (ROOT / "megarl" / "config" / "schema.py").read_text()))
    unread = sorted(keys - PLANNER_INPUTS - interpolated - keys_read(_run_sources(), MegarlConfig))
    assert not unread, f"config keys the run never reads: {unread}"


@pytest.mark.unit
def test_config_reads_follow_each_key_by_its_section(tmp_path):
    """The reader counts a key where its own section is read, through aliases, parameters and calls; a
    key of the same name in another section does not count."""
    import dataclasses

    from config_reads import keys_read

    @dataclasses.dataclass
    class Judge:
        temperature: float = 0.0
        timeout_s: float = 1.0

    @dataclasses.dataclass
    class Rollout:
        temperature: float = 1.0
        top_p: float = 1.0
        engine: str = "sglang"

    @dataclasses.dataclass
    class Reward:
        judge: Judge = dataclasses.field(default_factory=Judge)

    @dataclasses.dataclass
    class Run:
        steps: int = 1
        rollout: Rollout = dataclasses.field(default_factory=Rollout)
        reward: Reward = dataclasses.field(default_factory=Reward)

    source = tmp_path / "run.py"
    source.write_text(
        "def start(cfg):\n"
        "    r, j = cfg.rollout, cfg.reward.judge\n"
        "    sample(r)\n"
        "    Scorer(j).score()\n"
        "    return cfg.steps, r.engine_resource, 'engine', getattr(j, 'timeout_s')\n"
        "def sample(rollout):\n"
        "    return rollout.temperature\n"
        "class Scorer:\n"
        "    def __init__(self, settings):\n"
        "        self.settings = settings\n"
        "    def score(self):\n"
        "        return self.settings.timeout_s\n")
    assert keys_read([source], Run) == {"steps", "rollout.temperature", "reward.judge.timeout_s"}
    source.write_text(source.read_text().replace("return rollout.temperature", "return rollout.top_p"))
    assert "rollout.temperature" not in keys_read([source], Run)  # the judge's is not the rollout's


def _tied_copy(src: str, dst: Path, architecture: str, keep_lm_head: bool) -> Path:
    """``src`` with ``tie_word_embeddings`` set and ``architecture`` named, its lm_head kept or dropped."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in Path(src).iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((Path(src) / "config.json").read_text()) | {"tie_word_embeddings": True,
                                                                     "architectures": [architecture]}
    (dst / "config.json").write_text(json.dumps(config))
    weights = load_file(f"{src}/model.safetensors")
    if not keep_lm_head:
        del weights["lm_head.weight"]
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.unit
def test_tied_checkpoint_without_lm_head_is_refused_where_sglang_unties_it(tiny_checkpoint, tmp_path):
    def run(name, architecture, keep_lm_head):
        path = _tied_copy(tiny_checkpoint, tmp_path / name, architecture, keep_lm_head)
        return loaded(["recipe=tiny_moe_cpu", f"model.hf_path={path}", "warmup.steps=0"])

    with pytest.raises(ConfigError, match=r"^model.hf_path: .* ties its output layer to its embeddings .* "
                                          r"SGLang's Qwen3MoeForCausalLM does not tie them"):
        run("moe", "Qwen3MoeForCausalLM", keep_lm_head=False)
    run("moe_with_head", "Qwen3MoeForCausalLM", keep_lm_head=True)  # the engine loads the stored lm_head
    run("dense", "Qwen3ForCausalLM", keep_lm_head=False)  # SGLang's Qwen3 ties them itself
