"""Checks that Hydra's types cannot express, run before any process starts.

:func:`validate` (every load: the driver, the planner, ``--cfg job``) checks the config itself:
names against the registries of the code that uses them, layouts that do not divide, impossible
MoE settings, layouts that cannot be placed on the cluster (:class:`PlacementError`).
:func:`check_inputs` (the driver, before it starts anything; the planner plans for
machines whose files live elsewhere) checks what an RL run reads, as far as that is cheap: the
dataset file and its fields, the reward function's import, the rollout length against the
checkpoint's context, the agent program's import. Each check raises :class:`ConfigError` with ``"<key>: <why>"``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from megarl.agents.parsers import tool_call_parser
from megarl.agents.spec import load_agent
from megarl.algos.advantages import ADVANTAGES
from megarl.algos.aggregation import AGGREGATIONS
from megarl.algos.distill import OPD_BASELINES
from megarl.algos.gae import CRITIC_ADVANTAGES
from megarl.algos.kl import KL_ESTIMATORS
from megarl.algos.off_policy import CORRECTIONS, LEVELS, OLD_POLICIES
from megarl.algos.policy_loss import POLICY_LOSSES
from megarl.algos.rejection import CRITERIA as REJECTION_CRITERIA
from megarl.algos.rejection import parse_criteria
from megarl.config.errors import ConfigError
from megarl.config.schema import MODES, Placement, TransformerImpl
from megarl.engines.launch_plan import dtype_refusal, ipc_transport_refusal, memory_saver_refusal
from megarl.models.hf_config import hf_config_if_present
from megarl.models.layers import choose_layers
from megarl.models.lora import SYNC_MODES as LORA_SYNC_MODES
from megarl.models.lora import LoraSettings
from megarl.parallel import PipelineSplitError, stage_layer_counts
from megarl.platform.description import Platform, detect
from megarl.rollout.env import ENVIRONMENTS
from megarl.rollout.group import PARTIAL_ROLLOUT_MODES
from megarl.sync.transports import TRANSPORTS
from megarl.tasks.judge import check_judge_config
from megarl.tasks.prompts import DATASET_TASKS, TASKS, dataset_fields, has_chat_template
from megarl.tasks.rewards import REWARD_TYPES, check_reward_url, load_user_reward

# Config key -> the registry of its valid names (the tables the code looks the name up in).
REGISTRIES = {
    "mode": MODES,
    "task.name": TASKS,
    "reward.type": REWARD_TYPES,
    "algorithm.advantage": ADVANTAGES,
    "algorithm.policy_loss": POLICY_LOSSES,
    "algorithm.loss_agg": AGGREGATIONS,
    "algorithm.kl_type": KL_ESTIMATORS,
    "algorithm.opd_baseline": OPD_BASELINES,
    "algorithm.off_policy_correction": CORRECTIONS,
    "algorithm.off_policy_level": LEVELS,
    "algorithm.old_policy": OLD_POLICIES,
    "sync.transport": TRANSPORTS,
    "buffer.partial_rollout": PARTIAL_ROLLOUT_MODES,
    "lora.sync": LORA_SYNC_MODES,
}


class PlacementError(ConfigError):
    """The layout cannot be placed on the cluster: more ranks than devices, or engine ranks that
    do not divide the model (``python -m megarl.plan`` exits 2 on it, as on a layout that does not
    fit in memory)."""


def _fail(key: str, why: str) -> None:
    raise ConfigError(f"{key}: {_one_line(why)}")


def _one_line(text: str) -> str:
    """Messages of other libraries' errors may span lines; the CLI prints one."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def checkpoint_arch(hf_path: str) -> dict:
    """The MoE numbers of an HF checkpoint's config.json ({} when the checkpoint is not present);
    ``num_experts`` 0 for a dense model (a config.json naming no experts)."""
    hf = hf_config_if_present(hf_path)
    if hf is None:
        return {}
    return {"num_layers": hf.num_layers, "num_experts": hf.num_experts or 0,
            "num_attention_heads": hf.num_attention_heads, "num_query_groups": hf.num_query_groups}


def validate(cfg: DictConfig) -> None:
    if cfg.algorithm.advantage in CRITIC_ADVANTAGES:  # before the names: say why, not only that it is unknown
        _fail("algorithm.advantage", f"{cfg.algorithm.advantage} needs a critic (per-token values), not built yet; "
              f"choose one of {', '.join(ADVANTAGES)}")
    _check_names(cfg)
    _check_parallel(cfg)
    _check_placement(cfg)
    _check_rollout(cfg)
    _check_algorithm(cfg)
    _check_distillation(cfg)
    if cfg.task.name in DATASET_TASKS and not cfg.task.path:
        _fail("task.path", f"task {cfg.task.name} needs the dataset file")
    if cfg.task.chat_template and (cfg.task.name not in DATASET_TASKS or cfg.task.env or cfg.task.agent):
        _fail("task.chat_template", "renders the prompts of a single-turn dataset task (task.name jsonl or parquet, "
              "no task.env or task.agent: an agent's calls get the template from the gateway)")
    _check_reward(cfg.reward)
    if cfg.reward.type == "arithmetic" and cfg.task.name != "arithmetic":
        _fail("reward.type", f"the arithmetic reward scores the demo's sums (exactly the answer, then end of "
              f"sequence), not task.name={cfg.task.name}'s rows: choose exact_match, math (math-verify), remote "
              f"or function")
    _check_judge(cfg)
    _check_episodes(cfg.task, cfg.rollout.num_engines)
    _check_lora(cfg)
    if not 1 <= cfg.trainer.updates_per_step <= cfg.rollout.prompts_per_step:
        _fail("trainer.updates_per_step", f"must be between 1 and rollout.prompts_per_step "
              f"({cfg.rollout.prompts_per_step}): each update trains at least one prompt group, got "
              f"{cfg.trainer.updates_per_step}")
    if cfg.sync.bucket_mb < 0 or cfg.sync.timeout_s <= 0:
        _fail("sync.bucket_mb",
              f"bucket_mb must be >= 0 and timeout_s > 0, got {cfg.sync.bucket_mb}, {cfg.sync.timeout_s}")
    if cfg.mode == "async" and (cfg.buffer.max_staleness < 0 or cfg.buffer.max_buffer_batches < 1):
        _fail("buffer.max_staleness", "async mode needs max_staleness >= 0 and max_buffer_batches >= 1")
    _check_warmup(cfg)
    _check_optimizer_offload(cfg)


def _check_optimizer_offload(cfg: DictConfig) -> None:
    """``trainer.optimizer_cpu_offload`` is megatron-core's HybridDeviceOptimizer inside the distributed
    optimizer (``megarl/trainer/optimizer.py``): it keeps fp32 host copies of 16-bit parameters only."""
    if not cfg.trainer.optimizer_cpu_offload:
        return
    if cfg.model.dtype not in ("bfloat16", "float16"):
        _fail("trainer.optimizer_cpu_offload", f"offloads the fp32 master copies of 16-bit weights (megatron-core's "
              f"HybridDeviceOptimizer); with model.dtype={cfg.model.dtype} there are none: train in bfloat16 or "
              "turn the offload off")
    if not cfg.trainer.use_distributed_optimizer:
        _fail("trainer.optimizer_cpu_offload", "runs inside megatron-core's distributed optimizer: set "
              "trainer.use_distributed_optimizer=true")


def _check_warmup(cfg: DictConfig) -> None:
    """The warm-up is the tiny demos' supervised start on synthetic arithmetic problems: with any
    other task it would teach the model sums before RL on the dataset, so it is refused there."""
    w = cfg.warmup
    if w.steps < 0:
        _fail("warmup.steps", f"must be >= 0 (0: RL starts from model.hf_path), got {w.steps}")
    if cfg.mode == "warmup" and w.steps == 0:
        _fail("warmup.steps", "mode=warmup runs the warm-up alone: it needs warmup.steps >= 1")
    if w.steps > 0 and cfg.task.name != "arithmetic":
        _fail("warmup.steps", f"the warm-up trains on synthetic arithmetic problems (the tiny demos' start), "
              f"not on task.name={cfg.task.name}'s rows; set warmup.steps=0 to start RL from model.hf_path "
              f"(your SFT checkpoint)")


def _check_lora(cfg: DictConfig) -> None:
    """Settings an adapter can have; adapters an engine can serve."""
    try:
        lora = LoraSettings.from_config(cfg.lora)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if lora is None or lora.sync != "adapter":
        return
    if "router" in {t.rsplit(".", 1)[-1] for t in lora.target_modules}:
        _fail("lora.target_modules", "SGLang serves no adapter on the MoE router (gate); use lora.sync=merged")


def _check_names(cfg: DictConfig) -> None:
    for key, names in REGISTRIES.items():
        value = OmegaConf.select(cfg, key)
        if value not in names:
            _fail(key, f"{value!r} is not one of {', '.join(names)}")


def _check_parallel(cfg: DictConfig) -> None:
    p = cfg.parallel
    for key in ("world_size", "tp", "pp", "cp", "ep"):
        if p[key] < 1:
            _fail(f"parallel.{key}", f"must be >= 1, got {p[key]}")
    model_parallel = p.tp * p.pp * p.cp
    if p.world_size % model_parallel:
        _fail("parallel.world_size", f"{p.world_size} is not divisible by tp*pp*cp = {model_parallel}")
    etp = p.etp or p.tp
    expert_ranks_per_stage = p.world_size // p.pp
    if expert_ranks_per_stage % (p.ep * etp):
        _fail("parallel.ep",
              f"ep*etp = {p.ep * etp} does not divide the {expert_ranks_per_stage} ranks of a pipeline stage")
    if p.vpp is not None and p.pp == 1:
        _fail("parallel.vpp", "virtual pipeline stages need parallel.pp > 1")

    arch = {k: cfg.model.arch[k] for k in ("num_layers", "num_experts", "num_attention_heads", "num_query_groups")}
    for k, v in checkpoint_arch(cfg.model.hf_path).items():
        if arch[k] is not None and v is not None and arch[k] != v:
            _fail(f"model.arch.{k}", f"the recipe says {arch[k]}, {cfg.model.hf_path}/config.json says {v}")
        arch[k] = arch[k] if arch[k] is not None else v
    experts = arch["num_experts"] or 0
    if experts and experts % p.ep:
        _fail("parallel.ep", f"{experts} experts are not divisible by ep={p.ep}")
    if experts and p.tp > 1 and not p.sequence_parallel:
        _fail("parallel.sequence_parallel", "MoE with tp > 1 requires sequence_parallel=true (megatron-core)")
    if arch["num_layers"]:
        try:
            stage_layer_counts(arch["num_layers"], p.pp, p.vpp or 1, p.first_stage_layers, p.last_stage_layers)
        except PipelineSplitError as exc:
            _fail(exc.key, str(exc))
    if arch["num_attention_heads"] and arch["num_attention_heads"] % p.tp:
        _fail("parallel.tp", f"{arch['num_attention_heads']} attention heads are not divisible by tp={p.tp}")
    if arch["num_query_groups"] and arch["num_query_groups"] % p.tp and p.tp % arch["num_query_groups"]:
        _fail("parallel.tp", f"{arch['num_query_groups']} KV heads and tp={p.tp}: neither divides the other")
    if p.backend not in ("auto", "gloo", "nccl"):
        _fail("parallel.backend", f"must be auto, gloo or nccl, got {p.backend!r}")


def _arch_numbers(cfg: DictConfig) -> dict:
    """The recipe's architecture numbers, the checkpoint's where the recipe leaves one unset."""
    arch = {k: cfg.model.arch[k] for k in ("num_experts", "num_attention_heads", "num_query_groups")}
    for k, v in checkpoint_arch(cfg.model.hf_path).items():
        if k in arch and arch[k] is None:
            arch[k] = v
    return arch


def engine_devices_start(first_free: int, engine_tp: int, gpus_per_node: int) -> int:
    """The first device (counted across nodes) of engines of ``engine_tp`` ranks placed from device
    ``first_free`` on (the disaggregated policy engines: from the trainer's ``world_size``): rounded up
    so that no engine straddles a node it could fit in (an engine larger than a node starts on a node
    of its own)."""
    step = min(engine_tp, gpus_per_node)
    return -(-first_free // step) * step


@dataclass(frozen=True)
class AuxiliaryEngine:
    """An engine beside the policy's that holds devices of its own in either placement (nothing releases
    its memory while the trainer trains): a frozen model (the distillation teacher, an agent role's
    model) or the judge, serving ``hf_path`` on ``devices`` devices (its tensor-parallel ranks, ``ep`` of
    them expert-parallel, DP attention when ``dp_attention``) from ``first_device`` (counted across nodes).
    ``name``: its engine pool's in a run (``teacher``, ``judge``, ``role-<role>``); ``key``: the config
    entry that sets it (``teacher``, ``reward.judge``, ``task.role_engines[i]``, whose ``engine_tp`` and
    ``engine_ep`` errors name); ``role``: the agent role a frozen model serves, else None."""

    name: str
    key: str
    hf_path: str
    devices: int
    ep: int
    dp_attention: bool
    first_device: int
    role: str | None = None


def _policy_devices_end(cfg: DictConfig) -> int:
    """The first device after the trainer's and the policy engines' (counted across nodes)."""
    r, p, c = cfg.rollout, cfg.parallel, cfg.cluster
    if cfg.placement == "colocated":
        return p.world_size
    return engine_devices_start(p.world_size, r.engine_tp, c.gpus_per_node) + r.num_engines * r.engine_tp


def auxiliary_engines(cfg: DictConfig) -> list[AuxiliaryEngine]:
    """The run's auxiliary engines, placed in this order after the policy's devices, none straddling a
    node it fits in: the teacher (``teacher.engine_tp`` / ``engine_ep``, else the policy's; served like the
    policy's engines, DP attention included), the judge (``reward.judge.engine_tp`` / ``engine_ep``, no DP
    attention), each agent role a frozen model serves (its entry's ``engine_tp`` / ``engine_ep``, else the
    policy's; served like the teacher)."""
    r = cfg.rollout

    def frozen(name: str, key: str, entry: DictConfig, role: str | None = None) -> tuple:
        tp = r.engine_tp if entry.engine_tp is None else entry.engine_tp
        ep = r.engine_ep if entry.engine_ep is None else entry.engine_ep
        return name, key, entry.hf_path, tp, ep, r.engine_dp_attention, role

    wanted = [frozen("teacher", "teacher", cfg.teacher)] if cfg.teacher.hf_path else []
    judge = cfg.reward.judge
    if judge.hf_path:
        wanted.append(("judge", "reward.judge", judge.hf_path, judge.engine_tp, judge.engine_ep, False, None))
    if cfg.task.agent is not None:
        wanted += [frozen(f"role-{entry.role}", f"task.role_engines[{i}]", entry, entry.role)
                   for i, entry in enumerate(cfg.task.role_engines) if entry.hf_path]
    out, free = [], _policy_devices_end(cfg)
    for name, key, hf_path, tp, ep, dp_attention, role in wanted:
        first = engine_devices_start(free, tp, cfg.cluster.gpus_per_node)
        out.append(AuxiliaryEngine(name, key, hf_path, tp, ep, dp_attention, first, role))
        free = first + tp
    return out


def devices_needed(cfg: DictConfig) -> int:
    """Devices the layout occupies, counted across nodes from node 0 (with the gaps of
    :func:`engine_devices_start`): the trainer's (colocated: shared with the policy's engines), the
    policy engines', then the auxiliary engines' (:func:`auxiliary_engines`)."""
    auxiliary = auxiliary_engines(cfg)
    return auxiliary[-1].first_device + auxiliary[-1].devices if auxiliary else _policy_devices_end(cfg)


def _check_engine_split(key: str, tp: int, ep: int, dp_attention: bool, arch: dict, gpus_per_node: int) -> None:
    """An engine of ``tp`` ranks, ``ep`` of them expert-parallel, that divides its model (``arch``: the
    checkpoint's heads, KV heads and experts, None where unknown) and fits a node or whole nodes;
    errors name ``<key>.engine_tp`` / ``<key>.engine_ep``."""
    heads, kv_heads, experts = arch.get("num_attention_heads"), arch.get("num_query_groups"), arch.get("num_experts")
    if dp_attention and tp == 1:
        raise PlacementError(f"{key}.engine_tp: DP attention (rollout.engine_dp_attention) runs one attention replica "
                             "per rank and needs engine_tp > 1")
    if not dp_attention:  # DP attention: one attention replica per engine rank, nothing split
        if heads and heads % tp:
            raise PlacementError(f"{key}.engine_tp: {heads} attention heads are not divisible by engine_tp={tp}")
        if kv_heads and kv_heads % tp and tp % kv_heads:
            raise PlacementError(f"{key}.engine_tp: {kv_heads} KV heads and engine_tp={tp}: neither divides the other")
    if ep > 1 and experts == 0:
        raise PlacementError(f"{key}.engine_ep: {ep} expert-parallel ranks for a dense model (no experts to split)")
    if tp % ep or (experts and experts % ep):
        raise PlacementError(f"{key}.engine_ep: {ep} must divide engine_tp={tp}"
                             + (f" and the {experts} experts" if experts else ""))
    if gpus_per_node % tp and tp % gpus_per_node:
        raise PlacementError(f"{key}.engine_tp: an engine of {tp} ranks on nodes of cluster.gpus_per_node="
                             f"{gpus_per_node} would straddle nodes: one must divide the other")


def _auxiliary_engines_checked(cfg: DictConfig) -> list[AuxiliaryEngine]:
    """:func:`auxiliary_engines`, after their ``engine_tp`` and ``engine_ep`` settings are checked to be >= 1."""
    entries = [("teacher", cfg.teacher), ("reward.judge", cfg.reward.judge)] + \
        [(f"task.role_engines[{i}]", entry) for i, entry in enumerate(cfg.task.role_engines)]
    for key, entry in entries:
        for name in ("engine_tp", "engine_ep"):
            if entry[name] is not None and entry[name] < 1:
                raise PlacementError(f"{key}.{name}: must be >= 1, got {entry[name]}")
    return auxiliary_engines(cfg)


def _check_placement(cfg: DictConfig) -> None:
    """Engine ranks that divide the model; ranks that fit on the devices; the colocated weight
    sync's transport. The placement itself: :mod:`megarl.planner.placement`."""
    r, p, c = cfg.rollout, cfg.parallel, cfg.cluster
    for key, value in (("rollout.num_engines", r.num_engines), ("rollout.engine_tp", r.engine_tp),
                       ("rollout.engine_ep", r.engine_ep), ("cluster.gpus_per_node", c.gpus_per_node)):
        if value < 1:
            raise PlacementError(f"{key}: must be >= 1, got {value}")
    if c.num_nodes is not None and c.num_nodes < 1:
        raise PlacementError(f"cluster.num_nodes: must be >= 1 (or null), got {c.num_nodes}")
    _check_engine_split("rollout", r.engine_tp, r.engine_ep, r.engine_dp_attention, _arch_numbers(cfg),
                        c.gpus_per_node)
    for a in _auxiliary_engines_checked(cfg):
        _check_engine_split(a.key, a.devices, a.ep, a.dp_attention, checkpoint_arch(a.hf_path), c.gpus_per_node)
    gpn = c.gpus_per_node
    colocated = cfg.placement == "colocated"
    if colocated and r.num_engines * r.engine_tp > p.world_size:
        raise PlacementError(
            f"rollout.num_engines: colocated engines need {r.num_engines * r.engine_tp} devices "
            f"(num_engines x engine_tp = {r.num_engines} x {r.engine_tp}), more than the trainer's "
            f"{p.world_size} (parallel.world_size) by {r.num_engines * r.engine_tp - p.world_size}")
    needed = devices_needed(cfg)
    if c.num_nodes is not None and needed > c.num_nodes * gpn:
        what = (f"the trainer's {p.world_size} ranks" if colocated else
                f"{p.world_size} trainer ranks and {r.num_engines} engines x {r.engine_tp} ranks")
        auxiliary = auxiliary_engines(cfg)
        if auxiliary:
            what += " and the " + ", ".join(f"{a.name} engine's {a.devices}" for a in auxiliary)
        raise PlacementError(f"cluster.num_nodes: {what} need {needed} devices ({-(-needed // gpn)} nodes of "
                             f"{gpn}), more than {c.num_nodes} nodes x {gpn} = {c.num_nodes * gpn}")
    if colocated and cfg.sync.transport != "tensor":
        _fail("sync.transport", f"colocated placement needs sync.transport=tensor (the engines load the buckets "
              f"from the trainer's memory on the same devices), got {cfg.sync.transport!r}")


def _check_rollout(cfg: DictConfig) -> None:
    r = cfg.rollout
    if r.keep_sampling_mask and not 0 < r.top_k:
        _fail("rollout.top_k", "Keep Sampling Mask needs a finite top_k > 0 (the engine returns at most top_k ids)")
    if r.samples_per_prompt < 1 or r.prompts_per_step < 1:
        _fail("rollout.samples_per_prompt", "samples_per_prompt and prompts_per_step must be >= 1")
    if r.max_new_tokens < 1:
        _fail("rollout.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    if r.temperature < 0:
        _fail("rollout.temperature", f"must be >= 0, got {r.temperature}")
    if not 0 < r.top_p <= 1:
        _fail("rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    if not 0 < r.mem_fraction_static < 1:
        _fail("rollout.mem_fraction_static", f"must be in (0, 1), got {r.mem_fraction_static}")
    try:
        tool_call_parser(r.tool_call_parser, None)
    except ValueError as exc:  # the message names rollout.tool_call_parser
        raise ConfigError(_one_line(str(exc))) from exc


def _check_algorithm(cfg: DictConfig) -> None:
    a = cfg.algorithm
    if a.clip_absolute:
        if a.policy_loss != "cispo":
            _fail("algorithm.clip_absolute", f"applies to the cispo policy loss only, not {a.policy_loss}")
        if not 0 <= a.clip_low <= 1 <= a.clip_high:
            _fail("algorithm.clip_low", f"absolute bounds need 0 <= clip_low <= 1 <= clip_high, got {a.clip_low}, "
                  f"{a.clip_high}")
    elif not (0 <= a.clip_low < 1 and a.clip_high >= 0):
        _fail("algorithm.clip_low", f"need 0 <= clip_low < 1 and clip_high >= 0, got {a.clip_low}, {a.clip_high}")
    if a.dual_clip is not None:
        if a.policy_loss != "ppo":
            _fail("algorithm.dual_clip", f"applies to the ppo policy loss only, not {a.policy_loss}")
        if a.dual_clip <= 1:
            _fail("algorithm.dual_clip", f"must be > 1, got {a.dual_clip}")
    for key in ("sapo_tau_pos", "sapo_tau_neg"):
        if a[key] <= 0:
            _fail(f"algorithm.{key}", f"must be > 0, got {a[key]}")
    if a.loss_scale_factor < 1:
        _fail("algorithm.loss_scale_factor", f"must be >= 1, got {a.loss_scale_factor}")
    if a.off_policy_correction != "none" and a.is_threshold < 1:
        _fail("algorithm.is_threshold", f"must be >= 1, got {a.is_threshold}")
    if a.is_threshold_low is not None and not 0 <= a.is_threshold_low <= 1:
        _fail("algorithm.is_threshold_low", f"must be in [0, 1], got {a.is_threshold_low}")
    if a.off_policy_veto_threshold is not None and not 0 < a.off_policy_veto_threshold <= 1:
        _fail("algorithm.off_policy_veto_threshold", f"must be in (0, 1], got {a.off_policy_veto_threshold}")
    if a.off_policy_veto_threshold_high is not None and a.off_policy_veto_threshold_high < 1:
        _fail("algorithm.off_policy_veto_threshold_high", f"must be >= 1, got {a.off_policy_veto_threshold_high}")
    _check_rejection(a)


def _check_rejection(a: DictConfig) -> None:
    """The rejection criteria parse, and the old policy's correction is one that means something."""
    if a.off_policy_rejection is not None:
        names = [n.strip() for n in a.off_policy_rejection.split(",") if n.strip()]
        unknown = [n for n in names if n not in REJECTION_CRITERIA]
        if not names or unknown:
            _fail("algorithm.off_policy_rejection", f"{', '.join(map(repr, unknown)) or 'nothing'} is not one of "
                  f"{', '.join(REJECTION_CRITERIA)} (comma-separated, all must pass)")
        try:
            parse_criteria(a.off_policy_rejection, a.off_policy_rejection_threshold)
        except ValueError as exc:
            _fail("algorithm.off_policy_rejection_threshold", str(exc))
    elif a.off_policy_rejection_threshold is not None:
        _fail("algorithm.off_policy_rejection_threshold", "sets the bounds of off_policy_rejection: set it too")
    if a.old_policy == "rollout" and a.off_policy_correction != "none":
        _fail("algorithm.off_policy_correction", f"{a.off_policy_correction} weighs by the old/rollout ratio, which is "
              "1 under old_policy=rollout (the PPO ratio to the rollout policy is the correction, verl's bypass "
              "mode); use off_policy_rejection or the vetoes")


def _check_distillation(cfg: DictConfig) -> None:
    """On-policy distillation: a teacher and a weight go together; its token advantages leave no
    per-sequence advantage for off_policy_mask_kl."""
    a, teacher = cfg.algorithm, cfg.teacher.hf_path
    if a.opd_coef < 0:
        _fail("algorithm.opd_coef", f"must be >= 0, got {a.opd_coef}")
    if a.advantage == "opd" and not teacher:
        _fail("teacher.hf_path", "algorithm.advantage=opd distils from a teacher: set teacher.hf_path to its HF "
              "checkpoint")
    if teacher and a.opd_coef == 0:
        _fail("algorithm.opd_coef", "teacher.hf_path is set but opd_coef is 0: the teacher's scores would train "
              "nothing; set opd_coef > 0 (e.g. 1.0) or unset teacher.hf_path")
    if a.opd_coef > 0 and not teacher:
        _fail("teacher.hf_path", f"algorithm.opd_coef={a.opd_coef} needs a teacher: set teacher.hf_path")
    if teacher and a.off_policy_mask_kl is not None:
        _fail("algorithm.off_policy_mask_kl", "needs per-sequence advantages; on-policy distillation (teacher.hf_path) "
              "gives per-token ones")
    if cfg.teacher.timeout_s <= 0:
        _fail("teacher.timeout_s", f"must be > 0, got {cfg.teacher.timeout_s}")
    for name in ("engine_tp", "engine_ep"):
        if cfg.teacher[name] is not None and not teacher:
            _fail(f"teacher.{name}", "sets the ranks of the teacher's engine: set teacher.hf_path too")


def _check_reward(reward: DictConfig) -> None:
    for kind, key in (("remote", "url"), ("function", "path")):
        if reward.type == kind and not reward[key]:
            _fail(f"reward.{key}", f"reward type {kind} needs reward.{key}")
    if reward.timeout_s <= 0:
        _fail("reward.timeout_s", f"must be > 0, got {reward.timeout_s}")
    if reward.type == "remote":
        try:
            check_reward_url(reward.url)
        except ValueError as exc:  # the message names reward.url
            raise ConfigError(_one_line(str(exc))) from exc


def _check_judge(cfg: DictConfig) -> None:
    judge = cfg.reward.judge
    if not judge.hf_path:
        if judge.per_turn:
            _fail("reward.judge.per_turn", "per-turn judging needs a judge: set reward.judge.hf_path")
        return
    try:
        check_judge_config(judge)
    except ValueError as exc:  # the message names the reward.judge key
        raise ConfigError(_one_line(str(exc))) from exc
    if judge.timeout_s > cfg.reward.timeout_s:
        _fail("reward.judge.timeout_s", f"{judge.timeout_s} s exceeds reward.timeout_s ({cfg.reward.timeout_s} s), "
              "which bounds the whole reward")
    if judge.per_turn and not (cfg.task.env or cfg.task.agent):
        _fail("reward.judge.per_turn", "scores the turns of multi-turn episodes; set task.env or task.agent")


def _check_role_engines(task: DictConfig, num_engines: int) -> None:
    """``task.role_engines``: roles of ``task.roles``, each placed once, on distinct engine indices of
    the policy's ``num_engines``."""
    if task.roles is None:
        _fail("task.role_engines", "places the roles of task.roles on engines: set task.roles")
    for i, entry in enumerate(task.role_engines):
        if OmegaConf.is_missing(entry, "role"):
            _fail(f"task.role_engines[{i}].role", "missing: name the role its engines serve")
    placed = [entry.role for entry in task.role_engines]
    for i, entry in enumerate(task.role_engines):
        if entry.role not in task.roles:
            _fail(f"task.role_engines[{i}].role", f"{entry.role!r} is not one of task.roles {list(task.roles)}")
        if placed.count(entry.role) > 1:
            _fail(f"task.role_engines[{i}].role", f"{entry.role!r} is placed more than once")
        engines = list(entry.engines)
        for name in ("engine_tp", "engine_ep"):
            if entry.hf_path is None and entry[name] is not None:
                _fail(f"task.role_engines[{i}].{name}", f"sets the ranks of a frozen model's engine (with hf_path); "
                      f"{entry.role!r} is served by the policy's engines, whose ranks are rollout.{name}")
        if entry.hf_path is not None:
            if engines:
                _fail(f"task.role_engines[{i}]", f"{entry.role!r} is served by the frozen model "
                      f"hf_path={entry.hf_path} or by the policy's engines {engines}, not both")
            continue
        if not engines or len(set(engines)) != len(engines) or not all(0 <= e < num_engines for e in engines):
            _fail(f"task.role_engines[{i}].engines",
                  f"must be distinct engine indices in [0, {num_engines}) (rollout.num_engines={num_engines}), "
                  f"at least one; got {engines}")
    if all(entry.hf_path is not None for entry in task.role_engines) and \
            set(task.roles) <= {entry.role for entry in task.role_engines}:
        _fail("task.role_engines", f"every role of task.roles {list(task.roles)} is a frozen model: no role would "
              "be trained")


def _check_episodes(task: DictConfig, num_engines: int) -> None:
    """Multi-turn settings: one episode kind, budgets that allow a turn, roles only for agents, their
    engines among the policy's ``num_engines``."""
    if task.env is not None and task.env not in ENVIRONMENTS:
        _fail("task.env", f"{task.env!r} is not one of {', '.join(ENVIRONMENTS)}")
    if task.env is not None and task.agent is not None:
        _fail("task.agent", f"an episode is an environment's (task.env={task.env}) or an agent's, not both")
    if task.roles is not None and task.agent is None:
        _fail("task.roles", "roles are named by an agent program: set task.agent")
    if task.roles is not None and (not task.roles or len(set(task.roles)) != len(task.roles)):
        _fail("task.roles", f"must be distinct role names, got {list(task.roles)}")
    if task.role_engines:
        _check_role_engines(task, num_engines)
    if task.max_turns < 1:
        _fail("task.max_turns", f"must be >= 1, got {task.max_turns}")
    if task.max_response_tokens is not None and task.max_response_tokens < 1:
        _fail("task.max_response_tokens", f"must be >= 1 or null, got {task.max_response_tokens}")
    if task.agent_timeout_s <= 0:
        _fail("task.agent_timeout_s", f"must be > 0, got {task.agent_timeout_s}")


def check_inputs(cfg: DictConfig) -> None:
    """What an RL run reads, checked before it starts anything (a warm-up reads none of it)."""
    if cfg.mode == "warmup":
        return
    if cfg.task.name in DATASET_TASKS:
        _check_dataset(cfg.task)
    if cfg.reward.type == "function":
        try:
            load_user_reward(cfg.reward.path)  # imports the module: the run imports it again from the cache
        except ValueError as exc:  # the message names reward.path
            raise ConfigError(_one_line(str(exc))) from exc
    if cfg.task.agent is not None:
        try:
            load_agent(cfg.task.agent)  # imports the agent's module, as the run will
        except ValueError as exc:  # the message names task.agent
            raise ConfigError(_one_line(str(exc))) from exc
    checkpoint = _rl_start_checkpoint(cfg)
    if cfg.task.chat_template and checkpoint is not None and not has_chat_template(checkpoint):
        _fail("task.chat_template", f"the tokenizer saved with {checkpoint} has no chat template "
              "(no chat_template.jinja, nor a chat_template in tokenizer_config.json)")
    if cfg.teacher.hf_path:
        _check_teacher(cfg.teacher.hf_path, checkpoint)
    for i, entry in enumerate(cfg.task.role_engines if cfg.task.agent is not None else ()):
        if entry.hf_path is not None:
            _check_frozen_role(f"task.role_engines[{i}].hf_path", entry.role, entry.hf_path, checkpoint)
    if checkpoint is not None:
        context = hf_config_if_present(checkpoint).context_length
        if context is not None and cfg.rollout.max_new_tokens >= context:
            _fail("rollout.max_new_tokens", f"{cfg.rollout.max_new_tokens} leaves no room for a prompt in the model's "
                  f"context of {context} tokens ({checkpoint})")


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
        _fail(key, f"the tokenizer saved with {path} is not the policy's ({policy}): the gateway renders and "
              f"tokenizes the {role!r} role's calls with the policy's tokenizer and chat template")


def _check_same_vocabulary(key: str, what: str, path: str, policy: str | None, why: str) -> None:
    """``path`` is an HF checkpoint whose vocabulary size is the policy checkpoint's (when present)."""
    hf = hf_config_if_present(path)
    if hf is None:
        _fail(key, f"{path} is not an HF checkpoint directory (no config.json)")
    policy_hf = hf_config_if_present(policy) if policy is not None else None
    if policy_hf is not None and hf.vocab_size != policy_hf.vocab_size:
        _fail(key, f"{what}'s vocabulary ({hf.vocab_size} tokens, {path}) is not the policy's "
              f"({policy_hf.vocab_size}, {policy}): {why}")


def _rl_start_checkpoint(cfg: DictConfig) -> str | None:
    """The checkpoint RL starts from, if it is present: the warm-up's (which copies the base
    checkpoint's config) when the run warms up, else the base one."""
    candidates = ([cfg.warmup.save_hf_path] if cfg.warmup.steps > 0 else []) + [cfg.model.hf_path]
    return next((c for c in candidates if c and (Path(c) / "config.json").is_file()), None)


def _check_dataset(task: DictConfig) -> None:
    """The file exists and its rows have the prompt (and answer) fields; only the first rows
    (JSON Lines) or the schema (Parquet) are read."""
    if not Path(task.path).is_file():
        _fail("task.path", f"{task.path} does not exist (or is not a file)")
    try:
        names = dataset_fields(task.path, task.name)
    except (OSError, ValueError) as exc:
        _fail("task.path", str(exc))
    if names is None:  # not cheaply readable: the full read at start-up checks the fields
        return
    for key in ("prompt_key", "answer_key"):
        field = task[key]
        if field and field not in names:
            _fail(f"task.{key}", f"{field!r} is not a field of {task.path}; its rows have {', '.join(names)}")


def chosen_layers(cfg: DictConfig, platform: Platform) -> str:
    """The layers ``model.transformer_impl`` builds on ``platform`` (:func:`megarl.models.layers.choose_layers`),
    its refusal as a config error."""
    try:
        return choose_layers(TransformerImpl(cfg.model.transformer_impl).value, platform)
    except ValueError as exc:
        raise ConfigError(_one_line(str(exc))) from None


def check_context_parallel(cfg: DictConfig, platform: Platform) -> None:
    """``parallel.cp > 1`` needs transformer-engine's context-parallel attention: refused on a CPU
    ``platform`` and, on CUDA, with megatron's local layers (``model.transformer_impl=local``, or
    ``auto`` where transformer-engine does not import: the layer choice's own error,
    :func:`chosen_layers`); neither has a context-parallel path."""
    if cfg.parallel.cp <= 1:
        return
    if not platform.is_cuda:
        _fail("parallel.cp", "context parallelism needs transformer-engine's attention (CUDA); "
              "megatron's local attention on CPU has no context-parallel path")
    if chosen_layers(cfg, platform) == "local":
        _fail("parallel.cp", "context parallelism needs transformer-engine's attention; model.transformer_impl=local "
              "builds megatron's local attention, which has no context-parallel path: set model.transformer_impl="
              "transformer_engine (or auto)")


def refuse_on_platform(cfg: DictConfig, platform: Platform) -> None:
    """An RL run's engines on ``platform`` (:mod:`megarl.engines.launch_plan`): a dtype their kernels
    compute in, the colocated engines' memory release, CUDA IPC weight sync only between processes on
    the same GPUs."""
    why = dtype_refusal(platform, cfg.model.dtype)
    if why is not None:
        _fail("model.dtype", f"{cfg.model.dtype} on {platform.device}: {why}")
    placement = Placement(cfg.placement).value
    if placement == "colocated" and (why := memory_saver_refusal(platform)) is not None:
        _fail("placement", why)
    if cfg.sync.transport == "tensor" and (why := ipc_transport_refusal(platform, placement)) is not None:
        _fail("sync.transport", f"tensor with placement={placement}: {why}")


def refuse_what_is_not_built(cfg: DictConfig, platform: Platform | None = None) -> None:
    """``megarl.train``'s checks before it starts anything: the run's inputs (:func:`check_inputs`),
    what ``platform`` (default: this machine's) cannot run (:func:`refuse_on_platform`), then settings
    a run would otherwise ignore silently, refused until the code honours them (the planner still
    accepts them: big-model recipes plan with them)."""
    check_inputs(cfg)
    platform = detect() if platform is None else platform
    chosen_layers(cfg, platform)
    if cfg.mode != "warmup":
        refuse_on_platform(cfg, platform)
    r = cfg.rollout
    if cfg.trainer.optimizer_cpu_offload and not torch.cuda.is_available():
        _fail("trainer.optimizer_cpu_offload", "moves the Adam state from GPU to host memory with megatron-core's "
              "HybridDeviceOptimizer, which runs on CUDA streams; without a GPU the state is in host memory already: "
              "set it false")
    check_context_parallel(cfg, platform)
    if cfg.mode == "warmup":
        return
    if not torch.cuda.is_available():
        if r.engine_dp_attention:
            _fail("rollout.engine_dp_attention", "SGLang's CPU attention backend cannot run DP attention "
                  "('TorchNativeAttnBackend' has no get_cpu_graph_seq_len_fill_value); it runs on GPU engines")
        lora = LoraSettings.from_config(cfg.lora)
        if lora is not None and lora.sync == "adapter" and lora.targets_experts:
            _fail("lora.target_modules", "SGLang's CPU path cannot serve LoRA on the MoE layers' "
                  "linear_fc1/linear_fc2: "
                  "its LoRA MoE runs on the Triton fused-MoE kernels, whose config lookup fails without a GPU "
                  "(AttributeError: 'NoneType' object has no attribute 'replace', in fused_moe_triton_config.py); "
                  "target attention only (linear_qkv, linear_proj) or set lora.sync=merged")
        if r.engine_tp > 1 and cfg.sync.transport == "tensor":
            _fail("sync.transport", "the tensor transport into an engine of several ranks fails on CPU (engine rank 1 "
                  "cannot open the bucket's shared-memory file); use sync.transport=distributed or rollout.engine_tp=1")
