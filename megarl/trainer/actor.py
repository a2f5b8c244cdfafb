"""The trainer as a group of Ray actors, one per Megatron rank (one GPU each, or one CPU process).

The torch.distributed group is formed inside the actors; every call goes to all ranks with the same
arguments (one object-store copy of a batch). The trainer calls return what the reporting rank
returned (the last pipeline stage, TP rank 0, DP rank 0); the weight-sync calls return every
rank's result. The same ranks run the functions of :func:`megarl.trainer.launch.run_ranks`.

A rank runs one call at a time, except ``weight_sync_abort``: it runs in a concurrency group of its own
(``SYNC_ABORT_GROUP``), so that it reaches a rank whose call waits on a transfer stuck on a lost peer
(:meth:`megarl.sync.rank.RankSync.abort`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import ray
import torch

from megarl.parallel import Layout, free_port, rendezvous_host, role_resources
from megarl.parallel.places import Place, current_place
from megarl.sync.trainer_protocol import RANK_CALLS, RankCall, WeightSyncTrainer

log = logging.getLogger(__name__)

SYNC_ABORT_GROUP = "weight_sync_abort"  # the rank's concurrency group for the abort (one thread)


def rank_actor(num_cpus: float, num_gpus: float, rank_class: type | None = None):
    """``rank_class`` (default :class:`TrainerRank`) as a Ray actor class: one call at a time, the weight-sync
    abort besides."""
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus,
                      concurrency_groups={SYNC_ABORT_GROUP: 1})(rank_class or TrainerRank)


@dataclass(frozen=True)
class RankDevices:
    """What each trainer rank runs on: one GPU (``gpus``), on nodes of ``gpus_per_node`` GPUs, or a CPU process."""

    gpus: bool
    gpus_per_node: int = 8

    @classmethod
    def here(cls) -> RankDevices:
        """GPUs when this process sees one (the trainer's tools and tests; a run passes its platform's)."""
        return cls(torch.cuda.is_available())

    def bundles(self, world_size: int, resources: Mapping[str, float]) -> tuple[list[dict], str, list[int]]:
        """The placement group of ``world_size`` ranks asking ``resources`` each: its bundles, its strategy
        and each rank's bundle. On GPUs one bundle a node, of ``gpus_per_node`` GPUs (fewer on the last),
        on distinct nodes, rank ``r`` in bundle ``r // gpus_per_node``: the ranks fill the nodes in rank
        order, as the planner places them (``megarl/planner/placement.py``). On CPUs one bundle a rank,
        packed."""
        if not self.gpus:
            return [{"CPU": 1, **resources}] * world_size, "PACK", list(range(world_size))
        gpn = self.gpus_per_node
        sizes = [min(gpn, world_size - first) for first in range(0, world_size, gpn)]
        bundles = [{"GPU": n, "CPU": n, **{k: v * n for k, v in resources.items()}} for n in sizes]
        return bundles, "STRICT_SPREAD" if len(bundles) > 1 else "PACK", [r // gpn for r in range(world_size)]


def check_gpu_nodes(gpus_per_node: int, world_size: int) -> None:
    """RuntimeError naming ``cluster.gpus_per_node`` when the Ray cluster's GPU nodes do not have that many
    GPUs and it matters: on several GPU nodes every placement counts devices by it; on one, it must hold
    the ranks' first node (``min(gpus_per_node, world_size)`` GPUs)."""
    sizes = {n["NodeManagerAddress"]: int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")}
    sizes = {address: gpus for address, gpus in sizes.items() if gpus}
    other = {address: gpus for address, gpus in sizes.items() if gpus != gpus_per_node}
    if (len(sizes) > 1 and other) or (sizes and max(sizes.values()) < min(gpus_per_node, world_size)):
        raise RuntimeError(f"cluster.gpus_per_node={gpus_per_node}, but Ray's nodes offer {other} GPUs: set "
                           "cluster.gpus_per_node to the nodes' GPU count")


class TrainerRank:
    """One Megatron rank: its process groups, model, optimizer and schedule.

    The process is set up at creation; :meth:`join` makes it a rank of a group and :meth:`leave`
    undoes that, so that a kept process (:mod:`megarl.trainer.rank_pool`) can join another group."""

    def __init__(self):
        from megarl.log import setup_logging

        setup_logging()
        torch.set_num_threads(1)
        self.rank: int | None = None
        self.layout: Layout | None = None
        self.trainable = None
        self.reference = None
        self.critic = None
        self._weight_sync = None

    def join(self, rank: int, layout: Layout, master_addr: str, master_port: int, backend: str, seed: int,
             import_paths: Sequence[str] = ()) -> bool:
        """Join ``layout``'s group as ``rank`` (:func:`megarl.trainer.distributed.init_rank`); whether this
        rank reports the group's results (:meth:`is_reporter`)."""
        from megarl.trainer.distributed import init_rank

        sys.path.extend(p for p in import_paths if p not in sys.path)  # where run()'s functions live
        init_rank(rank, layout, master_addr, master_port, backend=backend, seed=seed)
        self.rank, self.layout = rank, layout
        return self.is_reporter()

    def leave(self) -> int:
        """Drop the weight-sync links, model, optimizer and reference, then megatron's groups and the
        process group: the process is as it was before :meth:`join` but for what it imported. Returns
        the process id (the pool's record, :mod:`megarl.trainer.rank_pool`)."""
        import gc

        from megarl.sync.gather import forget_groups
        from megarl.trainer.distributed import shutdown_rank

        if self._weight_sync is not None:
            self._weight_sync.abort()  # closes its links
        self._weight_sync = self.trainable = self.reference = self.critic = None
        self.rank = self.layout = None
        forget_groups()
        # Tensors of the last forward that megatron keeps on its modules (the MoE token dispatcher's) hold
        # an autograd graph whose grad accumulators' hooks hold the DDP: a cycle through autograd's C++
        # nodes that Python's collector cannot see, keeping the model and the process groups it used
        # (with their gloo threads, which poll). No graph outlives a group's work: cut them all.
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
                try:
                    obj.detach_()
                except RuntimeError:  # a view cannot be detached in place (none seen so far)
                    pass
        shutdown_rank()
        gc.collect()
        return os.getpid()

    def build(self, hf_path: str, optimizer, model, critic=None) -> int:
        """Build model, DDP and optimizer from the HF checkpoint (``optimizer``: OptimizerSettings,
        ``model``: models.bridge.ModelSettings), the KL reference from the same weights when asked, and
        the critic with ``critic`` (critic.CriticSettings); returns this rank's policy parameter count."""
        from megarl.trainer.critic import build_critic
        from megarl.trainer.model_setup import build_trainable
        from megarl.trainer.reference import ReferenceWeights

        self.trainable = build_trainable(hf_path, self.layout, optimizer, model)
        self.reference = ReferenceWeights(self.trainable.chunks) if model.reference else None
        self.critic = None if critic is None else build_critic(critic, self.layout, model)
        return sum(p.numel() for chunk in self.trainable.chunks for p in chunk.parameters())

    def is_reporter(self) -> bool:
        from megatron.core import parallel_state

        return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_data_parallel_rank() == 0)

    def node_address(self) -> str:
        """The address of the node this rank runs on (:func:`megarl.parallel.node_address`)."""
        from megarl.parallel import node_address

        return node_address()

    def place(self) -> Place:
        """Where this rank runs: its Ray node and GPU (:func:`megarl.parallel.places.current_place`)."""
        return current_place()

    def run(self, fn, *args):
        """``fn(rank, layout, *args)`` on this rank (:func:`megarl.trainer.launch.run_ranks`)."""
        return fn(self.rank, self.layout, *args)

    def rl_step(self, batch, algo, batching):
        from megarl.trainer.rl_step import rl_step

        t = self.trainable
        return rl_step(t.chunks, t.optimizer, t.scheduler, batch, algo, batching, reference=self.reference)

    def policy_logprobs(self, batch, batching):
        """The old-policy pass: ``megarl.trainer.rl_step.policy_logprobs`` of ``batch``."""
        from megarl.trainer.rl_step import policy_logprobs

        return policy_logprobs(self.trainable.chunks, batch, batching)

    def sequence_kl(self, batch, algo, batching):
        from megarl.trainer.rl_step import sequence_kl

        if self.reference is None:
            raise ValueError("algorithm.kl_in_reward needs the reference policy (built when algorithm.kl_coef != 0)")
        return sequence_kl(self.trainable.chunks, batch, algo.kl_type, self.reference, batching)

    def critic_values(self, batch, batching):
        """The critic's values of ``batch`` before the step's updates (``megarl.trainer.critic.critic_values``)."""
        from megarl.trainer.critic import critic_values

        return critic_values(self._built_critic().chunks, batch, batching)

    def critic_step(self, batch, batching, value_clip):
        """One critic update (``megarl.trainer.critic.critic_step``); its ``RLStepResult``."""
        from megarl.trainer.critic import critic_step

        c = self._built_critic()
        return critic_step(c.chunks, c.optimizer, c.scheduler, batch, batching, value_clip)

    def _built_critic(self):
        if self.critic is None:
            raise ValueError("no critic on this trainer (critic.enabled is false)")
        return self.critic

    def save_hf(self, out_dir: str) -> str:
        """Gather every shard into an HF checkpoint at ``out_dir`` (all ranks take part)."""
        from megarl.models.bridge import save_hf_checkpoint

        return str(save_hf_checkpoint(self.trainable.model, out_dir))

    def save_hf_adapter(self, out_dir: str) -> str:
        """Write the LoRA adapters as an HF PEFT directory at ``out_dir`` (all ranks take part)."""
        from megarl.models.bridge import save_hf_adapter

        if self.trainable.lora is None:
            raise ValueError("the model has no LoRA adapters (lora.enabled is false)")
        return str(save_hf_adapter(self.trainable.model, self.trainable.lora, out_dir))

    def save_checkpoint(self, root: str, step: int, data_position: dict) -> str:
        """Save model, optimizer, scheduler and RNG at ``step`` with the driver's data position (collective)."""
        from megarl.trainer.checkpoint import save_checkpoint

        return str(save_checkpoint(root, step, self.trainable, data_position, critic=self.critic))

    def load_checkpoint(self, root: str):
        """Restore the latest checkpoint under ``root``, the critic too when there is one (collective); returns
        its checkpoint.Resumed."""
        from megarl.trainer.checkpoint import load_checkpoint

        return load_checkpoint(root, self.trainable, critic=self.critic)

    # --- weight sync (megarl.sync.rank.RankSync holds the state; see it for each call's contract) ---
    def weight_sync(self, call: RankCall, *args):
        """``RankSync.<call>(*args)`` on this rank (``call``: one of
        :data:`megarl.sync.trainer_protocol.RANK_CALLS`; the abort is :meth:`weight_sync_abort`)."""
        from megarl.sync.rank import RankSync

        if call not in RANK_CALLS:
            raise ValueError(f"weight sync: no rank call {call!r}; one of {', '.join(RANK_CALLS)}")
        if self._weight_sync is None:
            self._weight_sync = RankSync(self.trainable.model)
        return getattr(self._weight_sync, call)(*args)

    @ray.method(concurrency_group=SYNC_ABORT_GROUP)
    def pid(self) -> int:
        """This rank's process id; answered while another call of this rank runs (the driver's watch:
        :mod:`megarl.pipeline.node_watch`)."""
        return os.getpid()

    @ray.method(concurrency_group=SYNC_ABORT_GROUP)
    def weight_sync_abort(self) -> None:
        """Drop the running sync and the links; runs while another call of this rank waits on a transfer."""
        if self._weight_sync is not None:  # nothing to drop on a rank that never linked
            self._weight_sync.abort()

    def export_hf_state(self) -> dict:
        """Every HF tensor, gathered by megatron-bridge's full export (all ranks take part)."""
        from megarl.models.bridge import export_hf_state

        return export_hf_state(self.trainable.model)


def _first_line(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


@ray.remote(num_cpus=0)
def _rendezvous_point() -> tuple[str, int]:
    """(host, port) for rank 0's TCP store, run on rank 0's node: its routable address in a
    multi-node cluster (loopback on one node) and a port free there."""
    host = rendezvous_host()
    return host, free_port(host)


class TrainerGroup(WeightSyncTrainer):
    """``layout.world_size`` :class:`TrainerRank` actors in one placement group.

    Every call runs on every rank with the same arguments. The trainer calls return the reporting
    rank's result; the weight-sync calls (:class:`megarl.sync.trainer_protocol.WeightSyncTrainer`)
    return every rank's result in rank order. ``import_paths`` are appended to the ranks'
    ``sys.path`` (where the functions given to :meth:`run` are imported from); ``env`` is set in the
    ranks' processes before they start (e.g. glibc's ``MALLOC_*`` tunables, read at exec); the ranks
    and the placement group are removed again when the group cannot start within ``startup_timeout_s``.
    ``devices``: one GPU a rank on nodes of a known size, or CPU processes (default: GPUs when this
    process sees one); on GPUs the ranks fill whole nodes in rank order (:meth:`RankDevices.bundles`),
    on a cluster whose GPU nodes all have that size (:func:`check_gpu_nodes`).

    The ranks meet at rank 0's node address (loopback when the cluster has one node) on a port a
    zero-CPU task in rank 0's bundle found free there (``master``); on a cluster with nodes that
    offer the ``megarl_trainer`` resource every bundle asks for a unit of it (docs/architecture.md,
    "Multi-node"). Inside :func:`megarl.trainer.rank_pool.keep_ranks` a group without ``env`` or trainer
    nodes takes kept processes on this node instead (no placement group) and
    :meth:`shutdown` hands them back. With ``wait=False`` the constructor returns once the ranks are
    placed and asked to join, before their processes have started: :meth:`joined` waits for them.
    ``rank_class`` (a class attribute) is what each rank's actor runs.
    """

    rank_class: type = TrainerRank

    def __init__(self, layout: Layout, backend: str = "auto", seed: int = 1234, *,
                 import_paths: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 startup_timeout_s: float = 600.0, wait: bool = True, devices: RankDevices | None = None):
        from megarl.trainer import rank_pool

        self.layout = layout
        self.ranks: list = []
        self.placement = None
        self._startup_timeout_s = startup_timeout_s
        self.devices = RankDevices.here() if devices is None else devices
        resources = role_resources("trainer")  # nodes set aside for trainer ranks, when the cluster has any
        kept = env is None and not resources
        self._pool = rank_pool.current() if kept and self.rank_class is TrainerRank else None
        try:
            if self._pool is not None:
                self._take_kept()
            else:
                self._place(resources, env)
            host, port = self.master
            self._joins = [rank.join.remote(r, layout, host, port, backend, seed, list(import_paths))
                           for r, rank in enumerate(self.ranks)]
            if wait:
                self.reporter = ray.get(self._joins, timeout=startup_timeout_s).index(True)
        except BaseException:
            self.shutdown(keep=False)
            raise

    def _take_kept(self) -> None:
        """The ranks from the kept processes of this node (:mod:`megarl.trainer.rank_pool`)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        host = rendezvous_host()  # the kept ranks run on this node
        self.master = (host, free_port(host))
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        kept = rank_actor(0, int(self.devices.gpus)).options(scheduling_strategy=here)
        self.ranks = self._pool.take(self.layout.world_size, kept.remote)

    def _place(self, resources: Mapping[str, float], env: Mapping[str, str] | None) -> None:
        """The ranks in a placement group of their own (:meth:`RankDevices.bundles`), and rank 0's rendezvous."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.devices.gpus:
            check_gpu_nodes(self.devices.gpus_per_node, self.layout.world_size)
        bundles, strategy, bundle_of = self.devices.bundles(self.layout.world_size, resources)
        self.placement = placement_group(bundles, strategy=strategy)
        ray.get(self.placement.ready(), timeout=self._startup_timeout_s)

        def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=self.placement, placement_group_bundle_index=index)

        # Rank 0's TCP store listens on its node: its address and a free port there, asked on that node.
        self.master = ray.get(_rendezvous_point.options(scheduling_strategy=in_bundle(bundle_of[0])).remote(),
                              timeout=self._startup_timeout_s)
        remote = rank_actor(1, int(self.devices.gpus), self.rank_class)
        self.ranks = [remote.options(scheduling_strategy=in_bundle(bundle_of[r]),
                                     runtime_env={"env_vars": dict(env)} if env else None).remote()
                      for r in range(self.layout.world_size)]

    async def joined(self) -> None:
        """Return once every rank joined the group (the constructor's wait, for a group made with
        ``wait=False``); the ranks are removed when one fails to or they take over ``startup_timeout_s``."""
        try:
            reports = await asyncio.wait_for(asyncio.gather(*self._joins), self._startup_timeout_s)
        except BaseException:
            self.shutdown(keep=False)
            raise
        self.reporter = reports.index(True)

    # --- trainer calls: each runs on every rank and returns the reporting rank's result ---------
    async def build(self, hf_path: str, optimizer, model, critic=None) -> int:
        """:meth:`TrainerRank.build` on every rank; the reporting rank's parameter count."""
        return await self._call("build", hf_path, optimizer, model, critic)

    async def rl_step(self, batch, algo, batching):
        """One RL optimizer step over ``batch`` (``megarl.trainer.rl_step.rl_step``); its ``RLStepResult``."""
        return await self._call("rl_step", batch, algo, batching)

    async def policy_logprobs(self, batch, batching):
        """The trainer's log-probs of ``batch`` before an update, float32 [N] (``rl_step.policy_logprobs``):
        the PPO ratio's old policy of a step's mini-batches."""
        return await self._call("policy_logprobs", batch, batching)

    async def critic_values(self, batch, batching):
        """The critic's values of ``batch``, float32 [N] (``megarl.trainer.critic.critic_values``)."""
        return await self._call("critic_values", batch, batching)

    async def critic_step(self, batch, batching, value_clip):
        """One critic update on ``batch`` (``megarl.trainer.critic.critic_step``); its ``RLStepResult``."""
        return await self._call("critic_step", batch, batching, value_clip)

    async def sequence_kl(self, batch, algo, batching) -> list[float]:
        """Per sample, the summed KL of the policy to the reference (``rl_step.sequence_kl``)."""
        return await self._call("sequence_kl", batch, algo, batching)

    async def save_checkpoint(self, root: str, step: int, data_position: dict) -> str:
        """Checkpoint under ``root`` at ``step`` with the driver's data position; its path."""
        return await self._call("save_checkpoint", root, step, data_position)

    async def load_checkpoint(self, root: str):
        """Restore the latest checkpoint under ``root``; its ``checkpoint.Resumed``."""
        return await self._call("load_checkpoint", root)

    async def export_hf_state(self) -> dict:
        """Every HF tensor of the model (megatron-bridge's full export, collective); the reporting rank's copy."""
        return await self._call("export_hf_state")

    async def save_hf(self, out_dir: str) -> str:
        """The model as an HF checkpoint at ``out_dir``; its path."""
        return await self._call("save_hf", out_dir)

    async def save_hf_adapter(self, out_dir: str) -> str:
        """The LoRA adapters as an HF PEFT directory at ``out_dir``; its path."""
        return await self._call("save_hf_adapter", out_dir)

    # --- weight sync (megarl.sync.trainer_protocol.WeightSyncTrainer): every rank's result, rank order ---
    async def on_ranks(self, call: RankCall | Literal["abort"], *args) -> list:
        """``RankSync.<call>(*args)`` on every rank (:meth:`TrainerRank.weight_sync`); the abort in the ranks'
        concurrency group of its own, so that it reaches a rank whose call blocks."""
        if call == "abort":
            return await self._call_all("weight_sync_abort")
        return await self._call_all("weight_sync", call, *args)

    # --- plumbing ---------------------------------------------------------------------------------
    async def node_addresses(self) -> list[str]:
        """The address of the node each rank runs on, in rank order."""
        return await self._call_all("node_address")

    async def dead_ranks(self, timeout_s: float) -> dict[int, str]:
        """Rank -> why, for each rank whose process is gone (Ray fails a call to it); a rank that does
        not answer within ``timeout_s`` is not counted (its process may be busy or its node slow)."""
        calls = [asyncio.wait_for(asyncio.wrap_future(rank.pid.remote().future()), timeout_s) for rank in self.ranks]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        return {r: _first_line(e) for r, e in enumerate(outcomes) if isinstance(e, ray.exceptions.RayActorError)}

    async def places(self) -> list[Place]:
        """Where each rank runs (its Ray node and GPU), in rank order."""
        return await self._call_all("place")

    def run(self, fn, *args) -> list:
        """Start ``fn(rank, layout, *args)`` on every rank; one ObjectRef per rank, in rank order
        (``fn`` must be importable by the ranks: see ``import_paths``)."""
        return self._submit("run", (fn, *args), {})

    async def _call(self, method: str, *args, **kwargs) -> Any:
        return (await self._call_all(method, *args, **kwargs))[self.reporter]

    async def _call_all(self, method: str, *args, **kwargs) -> list:
        return list(await asyncio.gather(*self._submit(method, args, kwargs)))

    def _submit(self, method: str, args: tuple, kwargs: dict) -> list:
        args = [ray.put(a) if not isinstance(a, (int, float, str, bool, type(None))) else a for a in args]
        return [getattr(r, method).remote(*args, **kwargs) for r in self.ranks]

    def shutdown(self, keep: bool = True) -> None:
        """Remove the ranks (and the placement group); kept processes go back to the pool after leaving
        the group, unless ``keep`` is false (after a failure a rank may be stuck in a collective)."""
        from ray.util.placement_group import remove_placement_group

        if self._pool is not None and keep:
            self._pool.give_back(self.ranks, lambda rank: rank.leave.remote())
        else:
            for rank in self.ranks:
                ray.kill(rank)
        self.ranks = []
        if self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None
