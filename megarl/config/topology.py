"""The run's topology: its trainer ranks and engine pools, their devices and how each engine is launched.

Built once from a loaded config (:attr:`megarl.config.schema.MegarlConfig.topology`) and read by the load-time checks
(:func:`check_topology`), the planner (``megarl/planner/placement.py``, ``megarl/plan.py``) and the
start-up (``megarl/pipeline/run.py``), so that they cannot disagree on which pools a run has or where.

Devices are counted across nodes (device ``g`` is device ``g % gpus_per_node`` of node ``g // gpus_per_node``).
Trainer rank ``i`` holds device ``i``. The policy's engines take the trainer's devices from device 0 when
colocated, else follow them (:func:`engine_devices_start`: no engine straddles a node it fits in). The
auxiliary pools follow, one engine each, on devices of their own in either placement (nothing releases
their memory while the trainer trains): the distillation teacher, the judge, each agent role a frozen
model serves.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from megarl.config.errors import PlacementError, fail
from megarl.engines.launch_plan import attention_backend, dtype_refusal, memory_saver_refusal
from megarl.engines.server import EngineSettings, lora_serving, nodes_of
from megarl.models.hf_config import checkpoint_arch, read_hf_config
from megarl.platform.description import Platform


def engine_devices_start(first_free: int, engine_tp: int, gpus_per_node: int) -> int:
    """The first device of engines of ``engine_tp`` ranks placed from device ``first_free`` on, rounded up
    so that no engine straddles a node it could fit in (an engine larger than a node starts on a node of
    its own)."""
    step = min(engine_tp, gpus_per_node)
    return -(-first_free // step) * step


class Placement(str, Enum):
    colocated = "colocated"  # trainer and engines share devices; engines release memory while training
    disaggregated = "disaggregated"  # separate device pools


@dataclass(frozen=True)
class EnginePoolSpec:
    """One engine pool of a run: ``num_engines`` SGLang servers of ``tp`` ranks (``ep`` of them expert-parallel,
    DP attention when ``dp_attention``) from device ``first_device`` on, serving ``hf_path`` (None: the
    policy's start checkpoint, known at start-up). ``name``: ``policy``, ``teacher``, ``judge`` or
    ``role-<role>``; ``key``: the config entry that sets its ranks (``rollout``, ``teacher``,
    ``reward.judge``, ``task.role_engines[i]``), which errors name; ``role``: the agent role a frozen model
    serves; ``colocated``: on the trainer's devices (the policy's, colocated); ``first_index``: the run-wide
    index of its first engine (its seed is ``task.seed`` plus that)."""

    name: str
    key: str
    hf_path: str | None
    num_engines: int
    tp: int
    ep: int
    dp_attention: bool
    first_device: int
    first_index: int
    colocated: bool = False
    role: str | None = None

    @property
    def devices(self) -> int:
        """Devices the pool holds (its engines' ranks)."""
        return self.num_engines * self.tp

    def engine_devices(self, engine: int) -> list[int]:
        """The devices of engine ``engine``'s ranks, in rank order."""
        start = self.first_device + engine * self.tp
        return list(range(start, start + self.tp))


@dataclass(frozen=True)
class RunTopology:
    """The trainer's ``trainer_ranks`` (``pipeline_stages`` stages) on devices 0.., and the engine ``pools``
    (the policy's first), on nodes of ``gpus_per_node`` devices placed ``placement``."""

    placement: Placement
    gpus_per_node: int
    trainer_ranks: int
    pipeline_stages: int
    pools: tuple[EnginePoolSpec, ...]

    @property
    def policy(self) -> EnginePoolSpec:
        return self.pools[0]

    @property
    def auxiliary(self) -> tuple[EnginePoolSpec, ...]:
        """The teacher's, the judge's and the frozen roles' pools, in placement order."""
        return self.pools[1:]

    @property
    def colocated(self) -> bool:
        return self.placement == Placement.colocated

    def pool(self, name: str) -> EnginePoolSpec:
        """The pool called ``name`` (KeyError naming the pools there are when none is)."""
        found = {p.name: p for p in self.pools}
        if name not in found:
            raise KeyError(f"no engine pool {name!r} in this run; its pools: {', '.join(found)}")
        return found[name]

    @property
    def devices_needed(self) -> int:
        """Devices the layout occupies, counted from node 0 with the gaps of :func:`engine_devices_start`."""
        last = self.pools[-1]
        return max(self.trainer_ranks, last.first_device + last.devices)

    @property
    def nodes(self) -> int:
        return -(-self.devices_needed // self.gpus_per_node)

    @property
    def engine_count(self) -> int:
        return sum(p.num_engines for p in self.pools)

    @classmethod
    def from_config(cls, cfg) -> RunTopology:
        """The topology of a run config (``parallel``, ``rollout``, ``cluster``, ``placement``, ``teacher``,
        ``reward.judge``, ``task.role_engines``): the teacher's and frozen roles' ranks default to the
        policy's (``rollout.engine_*``) and are served like them, DP attention included; the judge's are
        its own, without DP attention."""
        r, gpn = cfg.rollout, cfg.cluster.gpus_per_node
        placement = Placement(cfg.placement)
        colocated = placement == Placement.colocated
        first = 0 if colocated else engine_devices_start(cfg.parallel.world_size, r.engine_tp, gpn)
        policy = EnginePoolSpec("policy", "rollout", None, r.num_engines, r.engine_tp, r.engine_ep,
                                r.engine_dp_attention, first, 0, colocated=colocated)
        pools, free = [policy], first + policy.devices if not colocated else cfg.parallel.world_size
        for name, key, hf_path, tp, ep, dp_attention, role in _auxiliary_entries(cfg):
            start = engine_devices_start(free, tp, gpn)
            pools.append(EnginePoolSpec(name, key, hf_path, 1, tp, ep, dp_attention, start,
                                        pools[-1].first_index + pools[-1].num_engines, role=role))
            free = start + tp
        return cls(placement, gpn, cfg.parallel.world_size, cfg.parallel.pp, tuple(pools))


def _auxiliary_entries(cfg) -> list[tuple]:
    """(name, key, hf_path, tp, ep, dp_attention, role) of each auxiliary pool the config asks for."""
    r = cfg.rollout

    def frozen(name: str, key: str, entry, role: str | None = None) -> tuple:
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
    return wanted


def check_topology(topology: RunTopology, policy_arch: dict, num_nodes: int | None) -> None:
    """Engine ranks that divide their model (``policy_arch``: the policy's heads, KV heads and experts, None
    where unknown; an auxiliary pool's from its checkpoint) and fit a node or whole nodes; colocated engines
    within the trainer's devices; every device within ``num_nodes`` nodes (None: as many as needed).
    Raises :class:`PlacementError` naming the key."""
    gpn = topology.gpus_per_node
    for pool in topology.pools:
        arch = policy_arch if pool.name == "policy" else checkpoint_arch(pool.hf_path)
        _check_engine_split(pool, arch, gpn)
    policy = topology.policy
    if topology.colocated and policy.devices > topology.trainer_ranks:
        raise PlacementError(
            f"rollout.num_engines: colocated engines need {policy.devices} devices (num_engines x engine_tp = "
            f"{policy.num_engines} x {policy.tp}), more than the trainer's {topology.trainer_ranks} "
            f"(parallel.world_size) by {policy.devices - topology.trainer_ranks}")
    needed = topology.devices_needed
    if num_nodes is not None and needed > num_nodes * gpn:
        what = (f"the trainer's {topology.trainer_ranks} ranks" if topology.colocated else
                f"{topology.trainer_ranks} trainer ranks and {policy.num_engines} engines x {policy.tp} ranks")
        if topology.auxiliary:
            what += " and the " + ", ".join(f"{a.name} engine's {a.devices}" for a in topology.auxiliary)
        raise PlacementError(f"cluster.num_nodes: {what} need {needed} devices ({-(-needed // gpn)} nodes of "
                             f"{gpn}), more than {num_nodes} nodes x {gpn} = {num_nodes * gpn}")


def check_role_engines(task, num_engines: int) -> None:
    """``task.role_engines``: roles of ``task.roles``, each placed once, on distinct engine indices of
    the policy's ``num_engines`` or on a frozen model's engine (a pool of its own), not every role frozen.
    Raises :class:`ConfigError` naming the entry's key."""
    if task.roles is None:
        fail("task.role_engines", "places the roles of task.roles on engines: set task.roles")
    placed = [entry.role for entry in task.role_engines]
    for i, entry in enumerate(task.role_engines):
        if entry.role not in task.roles:
            fail(f"task.role_engines[{i}].role", f"{entry.role!r} is not one of task.roles {list(task.roles)}")
        if placed.count(entry.role) > 1:
            fail(f"task.role_engines[{i}].role", f"{entry.role!r} is placed more than once")
        engines = list(entry.engines)
        for name in ("engine_tp", "engine_ep"):
            if entry.hf_path is None and getattr(entry, name) is not None:
                fail(f"task.role_engines[{i}].{name}", f"sets the ranks of a frozen model's engine (with hf_path); "
                     f"{entry.role!r} is served by the policy's engines, whose ranks are rollout.{name}")
        if entry.hf_path is not None:
            if engines:
                fail(f"task.role_engines[{i}]", f"{entry.role!r} is served by the frozen model "
                     f"hf_path={entry.hf_path} or by the policy's engines {engines}, not both")
            continue
        if not engines or len(set(engines)) != len(engines) or not all(0 <= e < num_engines for e in engines):
            fail(f"task.role_engines[{i}].engines",
                 f"must be distinct engine indices in [0, {num_engines}) (rollout.num_engines={num_engines}), "
                  f"at least one; got {engines}")
    if all(entry.hf_path is not None for entry in task.role_engines) and \
            set(task.roles) <= {entry.role for entry in task.role_engines}:
        fail("task.role_engines", f"every role of task.roles {list(task.roles)} is a frozen model: no role would "
             "be trained")


def _check_engine_split(pool: EnginePoolSpec, arch: dict, gpus_per_node: int) -> None:
    """An engine of ``pool`` divides its model (``arch``) and fits a node or whole nodes; errors name
    ``<pool.key>.engine_tp`` / ``engine_ep``."""
    key, tp, ep = pool.key, pool.tp, pool.ep
    heads, kv_heads, experts = arch.get("num_attention_heads"), arch.get("num_query_groups"), arch.get("num_experts")
    if pool.dp_attention and tp == 1:
        raise PlacementError(f"{key}.engine_tp: DP attention (rollout.engine_dp_attention) runs one attention replica "
                             "per rank and needs engine_tp > 1")
    if not pool.dp_attention:  # DP attention: one attention replica per engine rank, nothing split
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


@dataclass(frozen=True)
class EngineLaunch:
    """The GPU decisions of one engine on a platform (:mod:`megarl.engines.launch_plan`): SGLang's attention
    backend (None off CUDA), its first GPU (colocated CUDA engines: 0, the first of the trainer GPUs it is
    pinned to at launch, :mod:`megarl.engines.pinning`; None: SGLang's 0), whether it starts with the memory
    saver (colocated CUDA engines release memory to the trainer), and the GPUs Ray reserves for it
    (disaggregated CUDA engines; 0 where they share the trainer's or run on the CPU)."""

    attention_backend: str | None
    base_gpu_id: int | None
    memory_saver: bool
    ray_gpus: int


def engine_launch(pool: EnginePoolSpec, platform: Platform, model_path: str) -> EngineLaunch:
    """How each engine of ``pool`` serving ``model_path`` is launched on ``platform``. A colocated pool
    on CUDA without the memory saver is a ValueError."""
    if not platform.is_cuda:
        return EngineLaunch(None, None, False, 0)
    backend = attention_backend(platform, mla=bool(read_hf_config(model_path).kv_lora_rank))
    if not pool.colocated:
        return EngineLaunch(backend, None, False, pool.tp)
    refusal = memory_saver_refusal(platform)
    if refusal is not None:
        raise ValueError(refusal)
    return EngineLaunch(backend, 0, True, 0)


def pool_engine_settings(cfg, topology: RunTopology, pool: EnginePoolSpec, platform: Platform, api_key: str | None,
                         model_path: str | None = None) -> list[EngineSettings]:
    """The settings of ``pool``'s engines on ``platform`` (``model_path``: the policy's start checkpoint;
    an auxiliary pool serves its own). Every engine is served in the trainer's dtype (SGLang's "auto"
    serves a float32 checkpoint in float16, which alone puts a ~3e-4 mean gap between the engine's and
    the trainer's log-probs; a dtype the platform's engines cannot compute in is a ValueError), with the
    rollout's KV-cache size and memory share, its seed ``task.seed`` + its run-wide index and its log in
    the run directory (``engine-<i>.log`` for the policy's, ``<name>.log`` else). The policy's and the
    frozen models' (teacher, roles) take sampling masks up to ``rollout.top_k`` tokens and the prefix-cache
    settings (the cache, the shared prefills), the judge SGLang's defaults; only the policy's return the
    support's log-probs with their masks (``algorithm.score_centering``) and serve the LoRA adapters (nothing
    else is synced), and only a single-turn run's policy engines start without their tokenizer
    (:func:`multi_turn`)."""
    model_path = pool.hf_path if model_path is None else model_path
    refusal = dtype_refusal(platform, cfg.model.dtype)
    if refusal is not None:
        raise ValueError(f"model.dtype={cfg.model.dtype}: {refusal}")
    r, run_dir = cfg.rollout, Path(cfg.logging.run_dir)
    policy, like_policy = pool.name == "policy", pool.name != "judge"
    out, launch = [], engine_launch(pool, platform, model_path)
    for e in range(pool.num_engines):
        index = pool.first_index + e
        out.append(EngineSettings(
            model_path=model_path, device=platform.device, dtype=cfg.model.dtype,
            attention_backend=launch.attention_backend, base_gpu_id=launch.base_gpu_id,
            memory_saver=launch.memory_saver, max_total_tokens=r.max_total_tokens,
            mem_fraction_static=r.mem_fraction_static, random_seed=cfg.task.seed + index, tp=pool.tp, ep=pool.ep,
            dp_attention=pool.dp_attention, nnodes=nodes_of(pool.tp, topology.gpus_per_node), api_key=api_key,
            log_path=str(run_dir / (f"engine-{index}.log" if policy else f"{pool.name}.log")),
            **(dict(sampling_mask_max_tokens=max(r.top_k, 1), prefix_cache=r.prefix_cache,
                    shared_prefill_min_tokens=r.shared_prefill_min_tokens) if like_policy else {}),
            support_logprobs=policy and cfg.algorithm.score_centering != "none",
            tokenizer=not policy or multi_turn(cfg),
            **(lora_serving(cfg.enabled_lora) if policy else {})))
    return out


def multi_turn(cfg) -> bool:
    """Whether the run's episodes have several turns (``task.env`` or ``task.agent``): only they send the
    policy's engines stop strings and grammars, which need the engine's tokenizer; single-turn prompts
    go as token ids with the rollout's plain sampling parameters, so those engines start without it."""
    return cfg.task.env is not None or cfg.task.agent is not None
