"""Cross-section rules of a config, checked at every load (the driver, the planner, ``--cfg job``) after
each key's own range or names (:func:`megarl.fields.out_of_bounds`, declared with the schema's fields):
layouts that do not divide the model, impossible MoE settings, what the algorithm, the teacher, the
reward, the judge and the episodes need of each other, the run's topology (:mod:`megarl.config.topology`:
engines that cannot be placed, :class:`PlacementError`). Each check raises :class:`ConfigError` with
``"<key>: <why>"``. What a run reads: :mod:`megarl.config.inputs`; what this machine cannot run:
:mod:`megarl.config.platform_rules`.
"""
from __future__ import annotations

from omegaconf import DictConfig

from megarl.agents.parsers import tool_call_parser
from megarl.algos.gae import CRITIC_ADVANTAGES
from megarl.algos.rejection import rejection_config_error
from megarl.config.errors import ConfigError, PlacementError, fail, one_line
from megarl.config.schema import MegarlConfig
from megarl.config.topology import check_role_engines, check_topology
from megarl.fields import out_of_bounds
from megarl.metrics.trackers import TRACKERS
from megarl.models.hf_config import InvalidHfConfig, checkpoint_arch, hf_config_if_present
from megarl.parallel import PipelineSplitError, stage_layer_counts
from megarl.sync.settings import delta_refusal
from megarl.tasks.judge import check_judge_config
from megarl.tasks.prompts import DATASET_TASKS
from megarl.tasks.rewards import check_reward_url

__all__ = ["PlacementError", "validate"]


def validate(cfg: DictConfig) -> None:
    """ConfigError naming the first key of ``cfg`` outside its bounds or in an impossible combination."""
    found = out_of_bounds(cfg, MegarlConfig)
    if found is not None:
        fail(*found)
    _check_checkpoint_configs(cfg)
    arch = _arch_numbers(cfg)
    _check_parallel(cfg, arch)
    check_topology(cfg.topology, arch, cfg.cluster.num_nodes)
    _check_sync(cfg)
    _check_rollout(cfg, arch)
    _check_algorithm(cfg)
    _check_algorithm_choices(cfg)
    _check_critic(cfg)
    _check_distillation(cfg)
    _check_task(cfg)
    _check_reward(cfg.reward)
    if cfg.reward.type == "arithmetic" and cfg.task.name != "arithmetic":
        fail("reward.type", f"the arithmetic reward scores the demo's sums (exactly the answer, then end of "
            f"sequence), not task.name={cfg.task.name}'s rows: choose exact_match, math (math-verify), remote "
            f"or function")
    _check_judge(cfg)
    _check_episodes(cfg.task, cfg.rollout.num_engines)
    _check_lora(cfg)
    if cfg.trainer.updates_per_step > cfg.rollout.prompts_per_step:
        fail("trainer.updates_per_step", f"must be between 1 and rollout.prompts_per_step "
            f"({cfg.rollout.prompts_per_step}): each update trains at least one prompt group, got "
            f"{cfg.trainer.updates_per_step}")
    _check_warmup(cfg)
    _check_optimizer_offload(cfg)
    _check_trackers(cfg.logging.trackers)
    _check_eval(cfg)


def checkpoint_keys(cfg: DictConfig) -> list[tuple[str, str]]:
    """(key, path) of every HF checkpoint directory the config names (set or not yet made)."""
    keys = [("model.hf_path", cfg.model.hf_path), ("warmup.save_hf_path", cfg.warmup.save_hf_path),
            ("critic.hf_path", cfg.critic.hf_path), ("teacher.hf_path", cfg.teacher.hf_path),
            ("reward.judge.hf_path", cfg.reward.judge.hf_path)]
    keys += [(f"task.role_engines[{i}].hf_path", e.hf_path) for i, e in enumerate(cfg.task.role_engines)]
    return [(key, path) for key, path in keys if path]


def _check_checkpoint_configs(cfg: DictConfig) -> None:
    """Every checkpoint's config.json that is present is a JSON object (every later read of it relies on that)."""
    for key, path in checkpoint_keys(cfg):
        try:
            hf_config_if_present(path)
        except InvalidHfConfig as exc:
            fail(key, str(exc))


def _check_sync(cfg: DictConfig) -> None:
    """The weight-sync transport against the placement, delta sync against the transport, sharded's needs."""
    if cfg.placement == "colocated" and cfg.sync.transport != "tensor":
        fail("sync.transport", f"colocated placement needs sync.transport=tensor (the engines load the buckets "
            f"from the trainer's memory on the same devices), got {cfg.sync.transport!r}")
    if cfg.sync.delta and (why := delta_refusal(cfg.sync.transport, cfg.lora.sync if cfg.lora.enabled else None)):
        fail("sync.delta", why)
    if cfg.sync.transport == "sharded":
        _check_sharded(cfg)


def _check_task(cfg: DictConfig) -> None:
    """A dataset task's file, and a chat template only where single-turn dataset prompts are rendered."""
    if cfg.task.name in DATASET_TASKS and not cfg.task.path:
        fail("task.path", f"task {cfg.task.name} needs the dataset file")
    if cfg.task.chat_template and (cfg.task.name not in DATASET_TASKS or cfg.task.env or cfg.task.agent):
        fail("task.chat_template", "renders the prompts of a single-turn dataset task (task.name jsonl or parquet, "
            "no task.env or task.agent: an agent's calls get the template from the gateway)")


def _check_sharded(cfg: DictConfig) -> None:
    """sync.transport=sharded: every trainer rank sends its own slices, planned on one pipeline stage, of the
    base weights (megarl/sync/sharded_rank.py)."""
    if cfg.parallel.pp > 1:
        fail("sync.transport", f"sharded resharding plans one pipeline stage, got parallel.pp={cfg.parallel.pp}; "
             "use sync.transport=distributed")
    if cfg.lora.enabled:
        fail("sync.transport", "sharded resharding sends the base weights' slices, not merged LoRA adapters "
             "(lora.enabled); use sync.transport=distributed")
    hf = hf_config_if_present(cfg.model.hf_path)
    if cfg.model.arch.num_shared_experts or (hf is not None and hf.num_shared_experts):
        fail("sync.transport", "sharded resharding does not map shared experts (SGLang may fuse them into its "
             "routed-expert kernel, a choice its /server_info does not report); use sync.transport=distributed")


def _arch_numbers(cfg: DictConfig) -> dict:
    """The recipe's architecture numbers, the checkpoint's where the recipe leaves one unset; a recipe
    number the checkpoint contradicts is an error."""
    keys = ("num_layers", "num_experts", "num_attention_heads", "num_query_groups", "vocab_size")
    arch = {k: getattr(cfg.model.arch, k) for k in keys}
    for k, v in checkpoint_arch(cfg.model.hf_path).items():
        if arch[k] is not None and v is not None and arch[k] != v:
            fail(f"model.arch.{k}", f"the recipe says {arch[k]}, {cfg.model.hf_path}/config.json says {v}")
        arch[k] = arch[k] if arch[k] is not None else v
    return arch


def _check_parallel(cfg: DictConfig, arch: dict) -> None:
    p = cfg.parallel
    model_parallel = p.tp * p.pp * p.cp
    if p.world_size % model_parallel:
        fail("parallel.world_size", f"{p.world_size} is not divisible by tp*pp*cp = {model_parallel}")
    etp = p.etp or p.tp
    if (p.world_size // p.pp) % (p.ep * etp):
        fail("parallel.ep", f"ep*etp = {p.ep * etp} does not divide the {p.world_size // p.pp} ranks of a pipeline "
            "stage")
    if p.vpp is not None and p.pp == 1:
        fail("parallel.vpp", "virtual pipeline stages need parallel.pp > 1")
    experts = arch["num_experts"] or 0
    if experts and experts % p.ep:
        fail("parallel.ep", f"{experts} experts are not divisible by ep={p.ep}")
    if experts and p.tp > 1 and not p.sequence_parallel:
        fail("parallel.sequence_parallel", "MoE with tp > 1 requires sequence_parallel=true (megatron-core)")
    if arch["num_layers"]:
        try:
            stage_layer_counts(arch["num_layers"], p.pp, p.vpp or 1, p.first_stage_layers, p.last_stage_layers)
        except PipelineSplitError as exc:
            fail(exc.key, str(exc))
    if arch["num_attention_heads"] and arch["num_attention_heads"] % p.tp:
        fail("parallel.tp", f"{arch['num_attention_heads']} attention heads are not divisible by tp={p.tp}")
    if arch["num_query_groups"] and arch["num_query_groups"] % p.tp and p.tp % arch["num_query_groups"]:
        fail("parallel.tp", f"{arch['num_query_groups']} KV heads and tp={p.tp}: neither divides the other")


def _check_rollout(cfg: DictConfig, arch: dict) -> None:
    """The sampling mask needs a finite top-k within the vocabulary (a larger one masks nothing, and the
    engine would send whole-vocabulary masks); the tool-call parser is one SGLang has; in-place pauses need
    requests in flight across a sync (not colocated)."""
    r, vocab = cfg.rollout, arch["vocab_size"]
    if r.keep_sampling_mask and r.top_k < 1:
        fail("rollout.top_k", "Keep Sampling Mask needs a finite top_k > 0 (the engine returns at most top_k ids)")
    if vocab and r.top_k >= vocab:
        fail("rollout.top_k", f"{r.top_k} is not below the model's vocabulary of {vocab} tokens: top-k would keep "
            f"every token, so the sampling mask would be off; set a top_k < {vocab}, or -1 for no top-k "
            "(with rollout.keep_sampling_mask=false)")
    if cfg.buffer.partial_rollout == "in_place" and cfg.placement == "colocated":
        fail("buffer.partial_rollout", "in_place keeps requests running across a weight sync; colocated placement "
             "holds none (its engines finish or abort them and release their memory while training): use "
             "continue or abort_resubmit")
    try:
        tool_call_parser(r.tool_call_parser, None)
    except ValueError as exc:  # the message names rollout.tool_call_parser
        raise ConfigError(one_line(str(exc))) from exc
    _check_elastic(cfg)


def _check_elastic(cfg: DictConfig) -> None:
    """Engines join only a disaggregated policy pool, never beyond what it starts with below."""
    r = cfg.rollout
    if r.max_engines is None:
        return
    if r.max_engines < r.num_engines:
        fail("rollout.max_engines", f"{r.max_engines} is below rollout.num_engines ({r.num_engines}): the pool "
            "starts with num_engines and grows up to max_engines")
    if cfg.placement == "colocated":
        fail("rollout.max_engines", "engines join a disaggregated pool only: colocated engines share the "
            "trainer's devices, which a joining node does not have (set placement=disaggregated or leave "
            "max_engines unset)")


def _check_lora(cfg: DictConfig) -> None:
    """Targets an adapter can have; adapters an engine can serve."""
    try:
        lora = cfg.enabled_lora
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if lora is None or lora.sync != "adapter":
        return
    if "router" in {t.rsplit(".", 1)[-1] for t in lora.target_modules}:
        fail("lora.target_modules", "SGLang serves no adapter on the MoE router (gate); use lora.sync=merged")


def _check_optimizer_offload(cfg: DictConfig) -> None:
    """``trainer.optimizer_cpu_offload`` is megatron-core's HybridDeviceOptimizer inside the distributed
    optimizer (``megarl/trainer/optimizer.py``): it keeps fp32 host copies of 16-bit parameters only."""
    if not cfg.trainer.optimizer_cpu_offload:
        return
    if cfg.model.dtype not in ("bfloat16", "float16"):
        fail("trainer.optimizer_cpu_offload", f"offloads the fp32 master copies of 16-bit weights (megatron-core's "
             f"HybridDeviceOptimizer); with model.dtype={cfg.model.dtype} there are none: train in bfloat16 or "
             "turn the offload off")
    if not cfg.trainer.use_distributed_optimizer:
        fail("trainer.optimizer_cpu_offload", "runs inside megatron-core's distributed optimizer: set "
             "trainer.use_distributed_optimizer=true")


def _check_eval(cfg: DictConfig) -> None:
    """What an evaluation needs: pass@k's k within the answers, held-out prompts of the task."""
    e = cfg.eval
    if e.interval == 0 and not e.before_training:
        return
    if e.pass_k > e.samples_per_prompt:
        fail("eval.pass_k", f"{e.pass_k} is more than eval.samples_per_prompt ({e.samples_per_prompt}): pass@k "
             "draws k of a prompt's answers")
    problems = (cfg.task.max_operand + 1) ** 2
    if cfg.task.name == "arithmetic" and e.prompts >= problems:
        fail("eval.prompts", f"{e.prompts} held-out problems leave none of the task's {problems} "
             f"(task.max_operand={cfg.task.max_operand}) to train on")


def _check_trackers(names) -> None:
    """``logging.trackers`` names trackers megarl has."""
    for name in names:
        if name not in TRACKERS:
            fail("logging.trackers", f"{name!r} is not one of {', '.join(TRACKERS)}")


def _check_warmup(cfg: DictConfig) -> None:
    """The warm-up is the tiny demos' supervised start on synthetic arithmetic problems: with any
    other task it would teach the model sums before RL on the dataset, so it is refused there."""
    w = cfg.warmup
    if cfg.mode == "warmup" and w.steps == 0:
        fail("warmup.steps", "mode=warmup runs the warm-up alone: it needs warmup.steps >= 1")
    if w.steps > 0 and cfg.task.name != "arithmetic":
        fail("warmup.steps", f"the warm-up trains on synthetic arithmetic problems (the tiny demos' start), "
             f"not on task.name={cfg.task.name}'s rows; set warmup.steps=0 to start RL from model.hf_path "
             f"(your SFT checkpoint)")


def _check_algorithm(cfg: DictConfig) -> None:
    a = cfg.algorithm
    if a.clip_absolute:
        if a.policy_loss != "cispo":
            fail("algorithm.clip_absolute", f"applies to the cispo policy loss only, not {a.policy_loss}")
        if not 0 <= a.clip_low <= 1 <= a.clip_high:
            fail("algorithm.clip_low", f"absolute bounds need 0 <= clip_low <= 1 <= clip_high, got {a.clip_low}, "
                 f"{a.clip_high}")
    elif not (0 <= a.clip_low < 1 and a.clip_high >= 0):
        fail("algorithm.clip_low", f"need 0 <= clip_low < 1 and clip_high >= 0, got {a.clip_low}, {a.clip_high}")
    if a.dual_clip is not None:
        if a.policy_loss != "ppo":
            fail("algorithm.dual_clip", f"applies to the ppo policy loss only, not {a.policy_loss}")
    _check_rejection(a)


def _check_algorithm_choices(cfg: DictConfig) -> None:
    """The covariance losses' band, the adaptive KL controller's place, and what the token-level estimator and
    score centering need of the rollout and the layout."""
    a = cfg.algorithm
    if a.policy_loss == "clip_cov" and not a.clip_cov_lb < a.clip_cov_ub:
        fail("algorithm.clip_cov_lb", f"must be below clip_cov_ub, got {a.clip_cov_lb} and {a.clip_cov_ub}")
    if a.kl_ctrl == "adaptive" and not (a.kl_in_reward and a.kl_coef > 0):
        fail("algorithm.kl_ctrl", "adaptive moves the coefficient of the KL penalty in the reward (verl's "
             "AdaptiveKLController, where it applies it): set algorithm.kl_in_reward=true and kl_coef > 0")
    multi_turn = cfg.task.env is not None or cfg.task.agent is not None
    if a.advantage == "reinforce_plus_plus":
        if multi_turn:
            fail("algorithm.advantage", "reinforce_plus_plus resets its returns at every untrained token (verl's "
                 "reset after EOS): an episode's observations would cut its reward off; use reinforce_pp or grpo")
        if a.off_policy_mask_kl is not None:
            fail("algorithm.off_policy_mask_kl", "needs per-sequence advantages; reinforce_plus_plus gives "
                 "per-token ones")
    if a.score_centering == "none":
        return
    if not cfg.rollout.keep_sampling_mask:
        fail("algorithm.score_centering", "centres over the engine's recorded sampling support: set "
             "rollout.keep_sampling_mask=true")
    if cfg.parallel.cp > 1:
        fail("algorithm.score_centering", f"the support's log-probs are not gathered over context-parallel ranks "
             f"(parallel.cp={cfg.parallel.cp}); use parallel.cp=1")
    if multi_turn:
        fail("algorithm.score_centering", "multi-turn episodes (task.env, task.agent) do not carry the engine's "
             "support log-probs across turns; use it with single-turn tasks")
    if a.policy_loss == "kl_cov":
        fail("algorithm.score_centering", "centres the policy gradient's score; kl_cov's per-token |logp - logp_old| "
             "penalty is part of its per-token loss and would be centred with it: use another policy loss")


def _check_critic(cfg: DictConfig) -> None:
    """GAE and the critic go together; what the critic is not built for is refused."""
    gae, critic = cfg.algorithm.advantage in CRITIC_ADVANTAGES, cfg.critic.enabled
    if gae and not critic:
        fail("critic.enabled", f"algorithm.advantage={cfg.algorithm.advantage} needs a critic's per-token values: "
             "set critic.enabled=true (PPO with a value model)")
    if critic and not gae:
        fail("algorithm.advantage", f"critic.enabled trains a value model that only gae uses, not "
             f"{cfg.algorithm.advantage}: set algorithm.advantage=gae or critic.enabled=false")
    if not critic:
        return
    if cfg.lora.enabled:
        fail("critic.enabled", "the critic is not built with LoRA: it trains all its weights; set lora.enabled=false")
    if cfg.parallel.cp > 1:
        fail("critic.enabled", f"the critic does not run under context parallelism (parallel.cp={cfg.parallel.cp}); "
             "use parallel.cp=1")
    if cfg.algorithm.off_policy_mask_kl is not None:
        fail("algorithm.off_policy_mask_kl", "needs per-sequence advantages; gae gives per-token ones")
    if cfg.teacher.hf_path:
        fail("algorithm.advantage", "gae takes the sequence reward alone; on-policy distillation's per-token "
             "advantages (teacher.hf_path) do not combine with it")


def _check_rejection(a: DictConfig) -> None:
    """The rejection criteria parse, and the old policy's correction is one that means something."""
    found = rejection_config_error(a.off_policy_rejection, a.off_policy_rejection_threshold)
    if found is not None:
        fail(*found)
    if a.old_policy == "rollout" and a.off_policy_correction != "none":
        fail("algorithm.off_policy_correction", f"{a.off_policy_correction} weighs by the old/rollout ratio, which is "
             "1 under old_policy=rollout (the PPO ratio to the rollout policy is the correction, verl's bypass "
             "mode); use off_policy_rejection or the vetoes")


def _check_distillation(cfg: DictConfig) -> None:
    """On-policy distillation: a teacher and a weight go together; its token advantages leave no
    per-sequence advantage for off_policy_mask_kl."""
    a, teacher = cfg.algorithm, cfg.teacher.hf_path
    if a.advantage == "opd" and not teacher:
        fail("teacher.hf_path", "algorithm.advantage=opd distils from a teacher: set teacher.hf_path to its HF "
             "checkpoint")
    if teacher and a.opd_coef == 0:
        fail("algorithm.opd_coef", "teacher.hf_path is set but opd_coef is 0: the teacher's scores would train "
             "nothing; set opd_coef > 0 (e.g. 1.0) or unset teacher.hf_path")
    if a.opd_coef > 0 and not teacher:
        fail("teacher.hf_path", f"algorithm.opd_coef={a.opd_coef} needs a teacher: set teacher.hf_path")
    if teacher and a.off_policy_mask_kl is not None:
        fail("algorithm.off_policy_mask_kl", "needs per-sequence advantages; on-policy distillation (teacher.hf_path) "
             "gives per-token ones")
    for name in ("engine_tp", "engine_ep"):
        if getattr(cfg.teacher, name) is not None and not teacher:
            fail(f"teacher.{name}", "sets the ranks of the teacher's engine: set teacher.hf_path too")


def _check_reward(reward: DictConfig) -> None:
    for kind, key in (("remote", "url"), ("function", "path")):
        if reward.type == kind and not getattr(reward, key):
            fail(f"reward.{key}", f"reward type {kind} needs reward.{key}")
    if reward.type == "remote":
        try:
            check_reward_url(reward.url)
        except ValueError as exc:  # the message names reward.url
            raise ConfigError(one_line(str(exc))) from exc


def _check_judge(cfg: DictConfig) -> None:
    judge = cfg.reward.judge
    if not judge.hf_path:
        if judge.per_turn:
            fail("reward.judge.per_turn", "per-turn judging needs a judge: set reward.judge.hf_path")
        return
    try:
        check_judge_config(judge)
    except ValueError as exc:  # the message names the reward.judge key
        raise ConfigError(one_line(str(exc))) from exc
    if judge.timeout_s > cfg.reward.timeout_s:
        fail("reward.judge.timeout_s", f"{judge.timeout_s} s exceeds reward.timeout_s ({cfg.reward.timeout_s} s), "
             "which bounds the whole reward")
    if judge.per_turn and not (cfg.task.env or cfg.task.agent):
        fail("reward.judge.per_turn", "scores the turns of multi-turn episodes; set task.env or task.agent")


def _check_episodes(task: DictConfig, num_engines: int) -> None:
    """Multi-turn settings: one episode kind, budgets that allow a turn, roles only for agents, their
    engines among the policy's ``num_engines``."""
    if task.env is not None and task.agent is not None:
        fail("task.agent", f"an episode is an environment's (task.env={task.env}) or an agent's, not both")
    if task.roles is not None and task.agent is None:
        fail("task.roles", "roles are named by an agent program: set task.agent")
    if task.agent_workers and task.agent is None:
        fail("task.agent_workers", "agent workers run an agent program's episodes: set task.agent")
    if task.roles is not None and (not task.roles or len(set(task.roles)) != len(task.roles)):
        fail("task.roles", f"must be distinct role names, got {list(task.roles)}")
    if task.role_engines:
        check_role_engines(task, num_engines)
