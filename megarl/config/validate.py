"""Checks that Hydra's types cannot express: layouts that do not divide, impossible MoE settings.

Each check raises :class:`ConfigError` with ``"<key>: <why>"`` before any process starts.
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from megarl.config.errors import ConfigError
from megarl.config.schema import MODES
from megarl.parallel import PipelineSplitError, stage_layer_counts


def _fail(key: str, why: str) -> None:
    raise ConfigError(f"{key}: {why}")


def checkpoint_arch(hf_path: str) -> dict:
    """The MoE numbers of an HF checkpoint's config.json ({} when the checkpoint is not present)."""
    cfg_file = Path(hf_path) / "config.json"
    if not cfg_file.is_file():
        return {}
    hf = json.loads(cfg_file.read_text())
    return {
        "num_layers": hf.get("num_hidden_layers"),
        "num_experts": hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts"),
        "num_attention_heads": hf.get("num_attention_heads"),
        "num_query_groups": hf.get("num_key_value_heads"),
    }


def validate(cfg: DictConfig) -> None:
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
        _fail("parallel.ep", f"ep*etp = {p.ep * etp} does not divide the {expert_ranks_per_stage} ranks of a pipeline stage")
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

    r = cfg.rollout
    if r.keep_sampling_mask and not 0 < r.top_k:
        _fail("rollout.top_k", "Keep Sampling Mask needs a finite top_k > 0 (the engine returns at most top_k ids)")
    if r.samples_per_prompt < 1 or r.prompts_per_step < 1:
        _fail("rollout.samples_per_prompt", "samples_per_prompt and prompts_per_step must be >= 1")
    if cfg.mode not in MODES:
        _fail("mode", f"{cfg.mode!r} is not one of {', '.join(MODES)}")
    if cfg.task.name not in ("arithmetic", "jsonl", "parquet"):
        _fail("task.name", f"{cfg.task.name!r} is not one of arithmetic, jsonl, parquet")
    if cfg.task.name != "arithmetic" and not cfg.task.path:
        _fail("task.path", f"task {cfg.task.name} needs the dataset file")
    from megarl.tasks.rewards import REWARD_TYPES

    if cfg.reward.type not in REWARD_TYPES:
        _fail("reward.type", f"{cfg.reward.type!r} is not one of {', '.join(REWARD_TYPES)}")
    for kind, key in (("remote", "url"), ("function", "path")):
        if cfg.reward.type == kind and not cfg.reward[key]:
            _fail(f"reward.{key}", f"reward type {kind} needs reward.{key}")
    if cfg.reward.timeout_s <= 0:
        _fail("reward.timeout_s", f"must be > 0, got {cfg.reward.timeout_s}")
    if cfg.sync.transport not in ("distributed", "tensor", "disk"):
        _fail("sync.transport", f"{cfg.sync.transport!r} is not one of distributed, tensor, disk")
    if cfg.sync.bucket_mb < 0 or cfg.sync.timeout_s <= 0:
        _fail("sync.bucket_mb", f"bucket_mb must be >= 0 and timeout_s > 0, got {cfg.sync.bucket_mb}, {cfg.sync.timeout_s}")
    if cfg.buffer.partial_rollout not in ("continue", "abort_resubmit"):
        _fail("buffer.partial_rollout", f"must be continue or abort_resubmit, got {cfg.buffer.partial_rollout!r}")
    if cfg.mode == "async" and (cfg.buffer.max_staleness < 0 or cfg.buffer.max_buffer_batches < 1):
        _fail("buffer.max_staleness", "async mode needs max_staleness >= 0 and max_buffer_batches >= 1")


def refuse_what_is_not_built(cfg: DictConfig) -> None:
    """Settings a run would otherwise ignore silently: refused by ``megarl.train`` until the code
    honours them (the planner still accepts them: big-model recipes plan with them)."""
    r = cfg.rollout
    if cfg.trainer.recompute != "none":
        _fail("trainer.recompute", "activation recompute is planned for (megarl.plan) but not applied by the trainer yet")
    if cfg.mode == "warmup":
        return
    if cfg.placement == "colocated":
        _fail("placement", "colocated (engines release their memory while the trainer runs) is not built yet; "
              "use placement=disaggregated")
    if r.engine_tp != 1 or r.engine_ep != 1 or r.engine_dp_attention:
        _fail("rollout.engine_tp", "engine TP/EP/DP-attention are planned for (megarl.plan) but not passed to SGLang yet")
    if cfg.algorithm.kl_coef != 0.0:
        _fail("algorithm.kl_coef", "the KL term needs a reference model, which the driver does not run yet")
