"""What an RL run reads, checked before it starts anything, as far as that is cheap: the trackers' packages,
the dataset file and its fields, the reward function's and the agent program's imports, the teacher's, the
critic's and frozen roles' checkpoints against the policy's vocabulary, the rollout length against the
checkpoint's context, a checkpoint's tied embeddings against the SGLang model that serves it, and that no
checkpoint the run loads is quantized (a ``quantization_config``: no FP8 path yet). The driver runs it
(:func:`megarl.config.platform_rules.refuse_what_is_not_built`); the planner does not (it plans for machines
whose files live elsewhere). Each check raises :class:`ConfigError` naming the key.
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from megarl.agents.spec import load_agent
from megarl.config.errors import ConfigError, fail, one_line
from megarl.config.validate import checkpoint_keys
from megarl.metrics.trackers import missing_tracker
from megarl.models.hf_config import hf_config_if_present, quantized_refusal
from megarl.tasks.prompts import DATASET_TASKS, dataset_fields, has_chat_template
from megarl.tasks.rewards import load_user_reward

# HF model types whose routers carry an aux-loss-free expert bias (e_score_correction_bias) that megatron-bridge
# maps to the router's expert_bias (megatron/bridge/models/deepseek/common.py, glm/glm45_bridge.py)
EXPERT_BIAS_FAMILIES = ("deepseek_v3", "glm4_moe")


def check_inputs(cfg: DictConfig) -> None:
    """What an RL run reads, checked before it starts anything (a warm-up reads only the policy's checkpoint)."""
    for key, path in checkpoint_keys(cfg):
        if (Path(path) / "config.json").is_file() and (why := checkpoint_files_problem(Path(path))) is not None:
            fail(key, why)
    _check_unquantized(cfg)
    if cfg.mode == "warmup":
        return
    missing = missing_tracker(cfg.logging.trackers)
    if missing is not None:
        fail("logging.trackers", missing)
    if cfg.task.name in DATASET_TASKS:
        _check_dataset(cfg.task)
    if cfg.reward.type == "function":
        try:
            load_user_reward(cfg.reward.path)  # imports the module: the run imports it again from the cache
        except ValueError as exc:  # the message names reward.path
            raise ConfigError(one_line(str(exc))) from exc
    if cfg.task.agent is not None:
        try:
            load_agent(cfg.task.agent)  # imports the agent's module, as the run will
        except ValueError as exc:  # the message names task.agent
            raise ConfigError(one_line(str(exc))) from exc
    checkpoint = _rl_start_checkpoint(cfg)
    if cfg.task.chat_template and checkpoint is not None and not has_chat_template(checkpoint):
        fail("task.chat_template", f"the tokenizer saved with {checkpoint} has no chat template "
             "(no chat_template.jinja, nor a chat_template in tokenizer_config.json)")
    if cfg.teacher.hf_path:
        _check_teacher(cfg.teacher.hf_path, checkpoint)
    if cfg.critic.enabled and cfg.critic.hf_path:
        _check_same_vocabulary("critic.hf_path", "the critic", cfg.critic.hf_path, checkpoint,
                               "it values the policy's token ids")
    for i, entry in enumerate(cfg.task.role_engines if cfg.task.agent is not None else ()):
        if entry.hf_path is not None:
            _check_frozen_role(f"task.role_engines[{i}].hf_path", entry.role, entry.hf_path, checkpoint)
    if cfg.model.moe_expert_bias_update_rate is not None and checkpoint is not None:
        model_type = hf_config_if_present(checkpoint).model_type
        if model_type not in EXPERT_BIAS_FAMILIES:
            fail("model.moe_expert_bias_update_rate", f"{checkpoint} is a {model_type} model, whose routers have no "
                 f"expert bias (the families with one: {', '.join(EXPERT_BIAS_FAMILIES)})")
    if checkpoint is not None:
        _check_served_output_layer(checkpoint)
        context = hf_config_if_present(checkpoint).context_length
        if context is not None and cfg.rollout.max_new_tokens >= context:
            fail("rollout.max_new_tokens", f"{cfg.rollout.max_new_tokens} leaves no room for a prompt in the model's "
                 f"context of {context} tokens ({checkpoint})")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def checkpoint_files_problem(checkpoint: Path) -> str | None:
    """What an HF checkpoint directory with a config.json lacks for megarl to load it: safetensors weights (the
    one file, or every shard its index lists) and a tokenizer; None when nothing."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{index} is not a safetensors index ({type(exc).__name__}: {one_line(str(exc))})"
        missing = [name for name in shards if not (checkpoint / name).is_file()]
        if missing:
            return (f"{checkpoint} lacks {len(missing)} of the {len(shards)} weight files its index lists "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): an unfinished download or copy?")
    elif not any(checkpoint.glob("*.safetensors")):
        return f"{checkpoint} holds no weights (no model.safetensors, nor a model.safetensors.index.json)"
    if not any((checkpoint / name).is_file() for name in TOKENIZER_FILES):
        return f"{checkpoint} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
    return None


def _check_unquantized(cfg: DictConfig) -> None:
    """Every checkpoint the run loads that is present has no ``quantization_config``
    (:func:`megarl.models.hf_config.quantized_refusal`)."""
    checkpoints = [("model.hf_path", cfg.model.hf_path, "the policy"), ("teacher.hf_path", cfg.teacher.hf_path,
                   "the teacher"), ("reward.judge.hf_path", cfg.reward.judge.hf_path, "the judge")]
    if cfg.critic.enabled:
        checkpoints.append(("critic.hf_path", cfg.critic.hf_path, "the critic"))
    for i, entry in enumerate(cfg.task.role_engines if cfg.task.agent is not None else ()):
        checkpoints.append((f"task.role_engines[{i}].hf_path", entry.hf_path, f"the frozen {entry.role!r} model"))
    for key, path, role in checkpoints:
        if path and (why := quantized_refusal(path, role)) is not None:
            fail(key, why)


def _check_teacher(teacher: str, student: str | None) -> None:
    """The teacher is an HF checkpoint that scores the student's token ids: the same vocabulary."""
    _check_same_vocabulary("teacher.hf_path", "the teacher", teacher, student, "it must score the student's token ids")


def _check_frozen_role(key: str, role: str, path: str, policy: str | None) -> None:
    """A frozen role's model is an HF checkpoint with the policy's tokenizer (the same token ids and chat
    template): the gateway renders and tokenizes every role's calls with the policy's."""
    _check_same_vocabulary(key, f"the frozen {role!r} model", path, policy, "the gateway tokenizes its calls "
                           "with the policy's tokenizer")
    if policy is None:
        return
    from transformers import AutoTokenizer

    frozen, own = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(policy)
    if frozen.get_vocab() != own.get_vocab() or frozen.chat_template != own.chat_template:
        fail(key, f"the tokenizer saved with {path} is not the policy's ({policy}): the gateway renders and "
             f"tokenizes the {role!r} role's calls with the policy's tokenizer and chat template")


def _check_same_vocabulary(key: str, what: str, path: str, policy: str | None, why: str) -> None:
    """``path`` is an HF checkpoint whose vocabulary size is the policy checkpoint's (when present)."""
    hf = hf_config_if_present(path)
    if hf is None:
        fail(key, f"{path} is not an HF checkpoint directory (no config.json)")
    policy_hf = hf_config_if_present(policy) if policy is not None else None
    if policy_hf is not None and hf.vocab_size != policy_hf.vocab_size:
        fail(key, f"{what}'s vocabulary ({hf.vocab_size} tokens, {path}) is not the policy's "
             f"({policy_hf.vocab_size}, {policy}): {why}")


def _check_served_output_layer(checkpoint: str) -> None:
    """A checkpoint whose output layer is its embedding table (``tie_word_embeddings``) and that stores no
    ``lm_head.weight`` needs an SGLang model that ties them itself: another one would serve an output layer
    no weight is ever loaded into (the weight sync sends the table once too, as megatron-bridge exports it)."""
    hf = hf_config_if_present(checkpoint)
    if not hf.tie_word_embeddings or "lm_head.weight" in _stored_tensor_names(Path(checkpoint)):
        return
    from megarl.engine_process.model_registry import ties_embeddings

    for architecture in hf.architectures:
        if ties_embeddings(architecture) is False:
            fail("model.hf_path", f"{checkpoint} ties its output layer to its embeddings (tie_word_embeddings) and "
                 f"stores no lm_head.weight, but SGLang's {architecture} does not tie them: its engines would "
                 "serve an output layer no weight was loaded into")


def _stored_tensor_names(checkpoint: Path) -> set[str]:
    """The tensor names of a safetensors checkpoint (its index, or its one file's header; empty without either)."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    if not (checkpoint / "model.safetensors").is_file():
        return set()
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _rl_start_checkpoint(cfg: DictConfig) -> str | None:
    """The checkpoint RL starts from, if it is present: the warm-up's (which copies the base
    checkpoint's config) when the run warms up, else the base one."""
    candidates = ([cfg.warmup.save_hf_path] if cfg.warmup.steps > 0 else []) + [cfg.model.hf_path]
    return next((c for c in candidates if c and (Path(c) / "config.json").is_file()), None)


def _check_dataset(task: DictConfig) -> None:
    """The file exists and its rows have the prompt (and answer) fields; only the first rows
    (JSON Lines) or the schema (Parquet) are read."""
    if not Path(task.path).is_file():
        fail("task.path", f"{task.path} does not exist (or is not a file)")
    try:
        names = dataset_fields(task.path, task.name)
    except (OSError, ValueError) as exc:
        fail("task.path", str(exc))
    if names is None:  # not cheaply readable: the full read at start-up checks the fields
        return
    for key in ("prompt_key", "answer_key"):
        field = getattr(task, key)
        if field and field not in names:
            fail(f"task.{key}", f"{field!r} is not a field of {task.path}; its rows have {', '.join(names)}")


