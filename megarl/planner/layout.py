"""The plan of one recipe's layout: parameter counts, trainer and engine memory, weight sync, GPUs,
and the limits it breaks (each as one line naming the limit and by how much)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from omegaconf import DictConfig

from megarl.config.schema import Placement
from megarl.config.topology import EnginePoolSpec
from megarl.planner.arch import Arch, resolve_arch, served_arch
from megarl.planner.delta_memory import busiest_node, delta_memory_problem, node_host_bytes
from megarl.planner.engine_memory import EngineMemory, engine_memory
from megarl.planner.lora import LoraPlan, lora_plan
from megarl.planner.metadata import MetadataPlan, metadata_plan
from megarl.planner.params import ParamCounts, count_params
from megarl.planner.placement import PlacementPlan, place
from megarl.planner.trainer_memory import StageMemory, trainer_memory
from megarl.planner.units import GIB, gib
from megarl.planner.weight_sync import WeightSyncPlan, weight_sync_plan


@dataclass(frozen=True)
class AuxiliaryPlan:
    """One auxiliary engine (teacher, judge, frozen agent role): where it is set, what it serves, and one
    of its GPUs' memory; ``memory`` is None when its checkpoint is not here to read (``why``)."""

    name: str
    key: str  # its config entry: teacher, reward.judge, task.role_engines[i]
    hf_path: str
    devices: int
    memory: EngineMemory | None
    why: str | None = None


def auxiliary_plan(engine: EnginePoolSpec, cfg: DictConfig) -> AuxiliaryPlan:
    """``engine``'s plan, its memory from its checkpoint's config.json when that is here."""
    arch = served_arch(engine.hf_path, f"{engine.key}.hf_path")
    if arch is None:
        return AuxiliaryPlan(engine.name, engine.key, engine.hf_path, engine.devices, None,
                             f"not planned: no config.json at {engine.hf_path}")
    return AuxiliaryPlan(engine.name, engine.key, engine.hf_path, engine.devices, engine_memory(arch, cfg, engine))


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
    metadata: MetadataPlan  # the step's per-token metadata: bytes and CPU seconds at each stage
    lora: LoraPlan | None = None  # the LoRA adapters (lora.enabled)
    auxiliary: list[AuxiliaryPlan] = field(default_factory=list)  # the teacher's, judge's, frozen roles' engines

    @property
    def peak_stage(self) -> StageMemory:
        return max(self.trainer, key=lambda s: s.total)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["placement"] = self.placement.to_dict()
        out["trainer"] = [dict(asdict(s), total=s.total) for s in self.trainer]
        out["params"]["mtp_excluded_from_total"] = True
        for path in ("new", "old"):
            out["metadata"][path]["driver_seconds"] = getattr(self.metadata, path).driver_seconds
        out["metadata"]["driver_ratio"] = self.metadata.driver_ratio
        if self.lora is not None:
            out["lora"].update(ratio=self.lora.ratio, trainable_fraction=self.lora.trainable_fraction)
        return out


def plan_layout(cfg: DictConfig) -> LayoutPlan:
    """Everything the planner computes for ``cfg`` (a loaded, validated config)."""
    arch = resolve_arch(cfg)
    r, p = cfg.rollout, cfg.parallel
    engine_gpus = r.num_engines * r.engine_tp
    colocated = Placement(cfg.placement) == Placement.colocated
    lora = lora_plan(arch, cfg)
    topology = cfg.topology
    auxiliary = topology.auxiliary
    return LayoutPlan(
        arch=arch, params=count_params(arch), trainer=trainer_memory(arch, cfg), engine=engine_memory(arch, cfg),
        sync=weight_sync_plan(arch, cfg, lora), trainer_gpus=cfg.parallel.world_size, engine_gpus=engine_gpus,
        total_gpus=(max(cfg.parallel.world_size, engine_gpus) if colocated else cfg.parallel.world_size + engine_gpus)
        + sum(engine.devices for engine in auxiliary),
        placement=place(topology), lora=lora,
        metadata=metadata_plan(arch, r, dp=p.world_size // (p.tp * p.pp * p.cp)),
        auxiliary=[auxiliary_plan(engine, cfg) for engine in auxiliary],
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
    out += _engine_limits(plan.engine, cfg, "engine", None)
    for a in plan.auxiliary:
        if a.memory is not None:
            out += _engine_limits(a.memory, cfg, f"{a.name} engine", a.key)
    if cfg.sync.delta and cfg.cluster.host_memory_gb is not None:
        why = delta_memory_problem(busiest_node(plan.arch, cfg), node_host_bytes(cfg), cfg.sync.transport)
        out += [f"sync.delta: {why}"] if why else []
    # Layouts that cannot be placed (engine_ep, engine_tp, more ranks than devices) are refused
    # when the config loads: megarl.config.topology.check_topology.
    return out


def _engine_limits(e: EngineMemory, cfg: DictConfig, what: str, key: str | None) -> list[str]:
    """The limit one GPU ``e`` of ``what`` (``engine``, ``teacher engine``) breaks, if any: its weights
    (and LoRA buffers) over SGLang's static pool, weights and a set KV cache over the pool, or a KV
    cache short of one sequence. A policy engine's lines name the rollout key; an auxiliary engine's
    (``key``: its config entry) name ``<key>.engine_tp``, its ranks."""
    r, limit = cfg.rollout, cfg.trainer.gpu_memory_gb
    held = e.weights + e.lora_buffers
    with_lora = f" + LoRA buffers {gib(e.lora_buffers):.1f} GB" if e.lora_buffers else ""
    ranks = f" on {e.gpus_per_engine} ranks" if key else ""
    if held > e.pool:
        return [f"{f'{key}.engine_tp' if key else 'rollout.mem_fraction_static'}: {what} weights take "
                f"{gib(e.weights):.1f} GB{with_lora} per GPU{ranks}, over SGLang's static pool of "
                f"{r.mem_fraction_static:g} x {limit:g} GB = {gib(e.pool):.1f} GB by {gib(held - e.pool):.1f} GB"]
    if held + e.kv_cache > e.pool:  # a policy engine with rollout.kv_cache_gb set
        return [f"rollout.kv_cache_gb: weights {gib(e.weights):.1f} GB{with_lora} + KV cache {gib(e.kv_cache):.1f} GB "
                f"per GPU exceed the static pool of {gib(e.pool):.1f} GB by {gib(held + e.kv_cache - e.pool):.1f} GB"]
    if e.kv_tokens_per_replica < e.max_sequence_tokens:
        return [f"{f'{key}.engine_tp' if key else 'rollout.max_new_tokens'}: the {what} KV cache holds "
                f"{e.kv_tokens_per_replica} tokens per attention replica{ranks}, short of one sequence of "
                f"max_prompt_tokens + max_new_tokens = {e.max_sequence_tokens} by "
                f"{e.max_sequence_tokens - e.kv_tokens_per_replica} tokens"]
    return []


def gib_dict(stage: StageMemory) -> dict[str, float]:
    """A stage's memory parts in GiB (for tables)."""
    parts = ("weights", "grads", "optimizer", "activations", "reserved", "critic", "total", "host_optimizer")
    return {k: getattr(stage, k) / GIB for k in parts}
