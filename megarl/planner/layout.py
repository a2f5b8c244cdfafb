"""The plan of one recipe's layout: parameter counts, trainer and engine memory, weight sync, GPUs,
and the limits it breaks (each as one line naming the limit and by how much)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from omegaconf import DictConfig

from megarl.config.schema import Placement
from megarl.config.validate import auxiliary_engines
from megarl.planner.arch import Arch, resolve_arch
from megarl.planner.engine_memory import EngineMemory, engine_memory
from megarl.planner.lora import LoraPlan, lora_plan
from megarl.planner.params import ParamCounts, count_params
from megarl.planner.placement import PlacementPlan, place
from megarl.planner.trainer_memory import StageMemory, trainer_memory
from megarl.planner.units import GIB, gib
from megarl.planner.weight_sync import WeightSyncPlan, weight_sync_plan


@dataclass(frozen=True)
class LayoutPlan:
    arch: Arch
    params: ParamCounts
    trainer: list[StageMemory]
    engine: EngineMemory
    sync: WeightSyncPlan
    trainer_gpus: int
    engine_gpus: int  # all engines together
    total_gpus: int  # the policy's engines share the trainer's GPUs when colocated; auxiliary engines have their own
    placement: PlacementPlan  # the node and device of every rank, the weight-sync groups
    lora: LoraPlan | None = None  # the LoRA adapters (lora.enabled)

    @property
    def peak_stage(self) -> StageMemory:
        return max(self.trainer, key=lambda s: s.total)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["placement"] = self.placement.to_dict()
        out["trainer"] = [dict(asdict(s), total=s.total) for s in self.trainer]
        out["params"]["mtp_excluded_from_total"] = True
        if self.lora is not None:
            out["lora"].update(ratio=self.lora.ratio, trainable_fraction=self.lora.trainable_fraction)
        return out


def plan_layout(cfg: DictConfig) -> LayoutPlan:
    """Everything the planner computes for ``cfg`` (a loaded, validated config)."""
    arch = resolve_arch(cfg)
    r = cfg.rollout
    engine_gpus = r.num_engines * r.engine_tp
    colocated = Placement(cfg.placement) == Placement.colocated
    lora = lora_plan(arch, cfg)
    return LayoutPlan(
        arch=arch, params=count_params(arch), trainer=trainer_memory(arch, cfg), engine=engine_memory(arch, cfg),
        sync=weight_sync_plan(arch, cfg, lora), trainer_gpus=cfg.parallel.world_size, engine_gpus=engine_gpus,
        total_gpus=(max(cfg.parallel.world_size, engine_gpus) if colocated else cfg.parallel.world_size + engine_gpus)
        + sum(engine.devices for engine in auxiliary_engines(cfg)),
        placement=place(cfg), lora=lora,
    )


def broken_limits(plan: LayoutPlan, cfg: DictConfig) -> list[str]:
    """One line per limit the layout breaks, naming the config key and by how much; [] if it fits."""
    out = []
    limit = cfg.trainer.gpu_memory_gb
    peak = plan.peak_stage
    if gib(peak.total) > limit:
        out.append(
            f"trainer.gpu_memory_gb: a trainer GPU of pipeline stage {peak.stage} needs {gib(peak.total):.1f} GB, "
            f"over the {limit:g} GB limit by {gib(peak.total) - limit:.1f} GB"
        )
    e, r = plan.engine, cfg.rollout
    held = e.weights + e.lora_buffers
    with_lora = f" + LoRA buffers {gib(e.lora_buffers):.1f} GB" if e.lora_buffers else ""
    if held > e.pool:
        out.append(
            f"rollout.mem_fraction_static: engine weights take {gib(e.weights):.1f} GB{with_lora} per GPU, over "
            f"SGLang's static pool of {r.mem_fraction_static:g} x {limit:g} GB = {gib(e.pool):.1f} GB "
            f"by {gib(held - e.pool):.1f} GB"
        )
    elif held + e.kv_cache > e.pool:
        out.append(
            f"rollout.kv_cache_gb: weights {gib(e.weights):.1f} GB{with_lora} + KV cache {gib(e.kv_cache):.1f} GB "
            f"per GPU exceed the static pool of {gib(e.pool):.1f} GB by {gib(held + e.kv_cache - e.pool):.1f} GB"
        )
    elif e.kv_tokens_per_replica < e.max_sequence_tokens:
        out.append(
            f"rollout.max_new_tokens: the KV cache holds {e.kv_tokens_per_replica} tokens per attention replica, "
            f"short of one sequence of max_prompt_tokens + max_new_tokens = {e.max_sequence_tokens} "
            f"by {e.max_sequence_tokens - e.kv_tokens_per_replica} tokens"
        )
    # Layouts that cannot be placed (engine_ep, engine_tp, more ranks than devices) are refused
    # when the config loads: megarl.config.validate.PlacementError.
    return out


def gib_dict(stage: StageMemory) -> dict[str, float]:
    """A stage's memory parts in GiB (for tables)."""
    parts = ("weights", "grads", "optimizer", "activations", "reserved", "total", "host_optimizer")
    return {k: getattr(stage, k) / GIB for k in parts}
