"""The trainer as a group of Ray actors, one per Megatron rank (one GPU each, or one CPU process).

The torch.distributed group is formed inside the actors; every call goes to all ranks with the same
arguments (one object-store copy of a batch), and the group returns what the reporting rank
returned (the last pipeline stage, TP rank 0, DP rank 0).
"""
from __future__ import annotations

import logging
from typing import Any

import ray
import torch

from megarl.parallel import Layout, free_port

log = logging.getLogger(__name__)


class TrainerRank:
    """One Megatron rank: its process groups, model, optimizer and schedule."""

    def __init__(self, rank: int, layout: Layout, master_port: int, backend: str, seed: int):
        from megarl.log import setup_logging
        from megarl.trainer.distributed import init_rank

        setup_logging()
        torch.set_num_threads(1)
        self.rank, self.layout = rank, layout
        init_rank(rank, layout, "127.0.0.1", master_port, backend=backend, seed=seed)
        self.trainable = None

    def build(self, hf_path: str, settings, transformer_impl: str, dispatcher: str, routing_replay: bool) -> int:
        """Build model, DDP and optimizer from the HF checkpoint; returns this rank's parameter count."""
        from megarl.trainer.model_setup import build_trainable

        self.trainable = build_trainable(hf_path, self.layout, settings, transformer_impl=transformer_impl,
                                         dispatcher=dispatcher, routing_replay=routing_replay)
        return sum(p.numel() for chunk in self.trainable.chunks for p in chunk.parameters())

    def is_reporter(self) -> bool:
        from megatron.core import parallel_state

        return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                and parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0)

    def rl_step(self, batch, algo, **kwargs):
        from megarl.trainer.rl_step import rl_step

        t = self.trainable
        return rl_step(t.chunks, t.optimizer, t.scheduler, batch, algo, **kwargs)

    def save_hf(self, out_dir: str) -> str:
        """Gather every shard into an HF checkpoint at ``out_dir`` (all ranks take part)."""
        from megarl.models.bridge import save_hf_checkpoint

        return str(save_hf_checkpoint(self.trainable.model, out_dir))

    def save_checkpoint(self, root: str, step: int, data_position: dict) -> str:
        """Save model, optimizer, scheduler and RNG at ``step`` with the driver's data position (collective)."""
        from megarl.trainer.checkpoint import save_checkpoint

        return str(save_checkpoint(root, step, self.trainable, data_position))

    def load_checkpoint(self, root: str):
        """Restore the latest checkpoint under ``root`` (collective); returns its checkpoint.Resumed."""
        from megarl.trainer.checkpoint import load_checkpoint

        return load_checkpoint(root, self.trainable)

    # --- weight sync (megarl.sync.rank.RankSync holds the state; see it for each step's contract) ---
    def _rank_sync(self):
        from megarl.sync.rank import RankSync

        if getattr(self, "_weight_sync", None) is None:
            self._weight_sync = RankSync(self.trainable.model)
        return self._weight_sync

    def weight_sync_address(self):
        return self._rank_sync().address()

    def weight_sync_connect(self, spec) -> None:
        self._rank_sync().connect(spec)

    def weight_sync_disconnect(self, kind: str) -> None:
        self._rank_sync().disconnect(kind)

    def weight_sync_begin(self, kind: str, version: int, capacity: int) -> None:
        self._rank_sync().begin(kind, version, capacity)

    def weight_sync_next(self):
        return self._rank_sync().next()

    def weight_sync_send(self):
        return self._rank_sync().send()

    def weight_sync_finish(self):
        return self._rank_sync().finish()

    def weight_sync_abort(self) -> None:
        self._rank_sync().abort()

    def export_hf_state(self) -> dict:
        """Every HF tensor, gathered by megatron-bridge's full export (all ranks take part)."""
        from megarl.models.bridge import export_hf_state

        return export_hf_state(self.trainable.model)


class TrainerGroup:
    """``layout.world_size`` :class:`TrainerRank` actors in one placement group."""

    def __init__(self, layout: Layout, backend: str = "auto", seed: int = 1234):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = 1 if torch.cuda.is_available() else 0
        bundle = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
        self.placement = placement_group([bundle] * layout.world_size, strategy="PACK")
        ray.get(self.placement.ready(), timeout=600)
        port = free_port()
        remote = ray.remote(num_cpus=1, num_gpus=gpus)(TrainerRank)
        self.ranks = [
            remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement, placement_group_bundle_index=r)).remote(r, layout, port, backend, seed)
            for r in range(layout.world_size)
        ]
        self.reporter = ray.get([r.is_reporter.remote() for r in self.ranks]).index(True)

    # --- typed calls: each runs on every rank and returns the reporting rank's result ---------
    async def build(self, hf_path: str, settings, transformer_impl: str, dispatcher: str, routing_replay: bool) -> int:
        """:meth:`TrainerRank.build` on every rank; the reporting rank's parameter count."""
        return await self.call_async("build", hf_path, settings, transformer_impl, dispatcher, routing_replay)

    async def rl_step(self, batch, algo, **kwargs):
        """One RL optimizer step over ``batch`` (``megarl.trainer.rl_step.rl_step``); its ``RLStepResult``."""
        return await self.call_async("rl_step", batch, algo, **kwargs)

    async def save_checkpoint(self, root: str, step: int, data_position: dict) -> str:
        """Checkpoint under ``root`` at ``step`` with the driver's data position; its path."""
        return await self.call_async("save_checkpoint", root, step, data_position)

    async def load_checkpoint(self, root: str):
        """Restore the latest checkpoint under ``root``; its ``checkpoint.Resumed``."""
        return await self.call_async("load_checkpoint", root)

    def call(self, method: str, *args, **kwargs) -> Any:
        """Run ``method`` on every rank; return the reporting rank's result."""
        return ray.get(self._submit(method, args, kwargs))[self.reporter]

    async def call_async(self, method: str, *args, **kwargs) -> Any:
        """:meth:`call` for an asyncio loop: awaits every rank, returns the reporting rank's result."""
        import asyncio

        return (await asyncio.gather(*self._submit(method, args, kwargs)))[self.reporter]

    def _submit(self, method: str, args: tuple, kwargs: dict) -> list:
        args = [ray.put(a) if not isinstance(a, (int, float, str, bool, type(None))) else a for a in args]
        return [getattr(r, method).remote(*args, **kwargs) for r in self.ranks]

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for rank in self.ranks:
            ray.kill(rank)
        remove_placement_group(self.placement)

    async def call_all_async(self, method: str, *args, **kwargs) -> list:
        """Run ``method`` on every rank; every rank's result, in rank order."""
        import asyncio

        return list(await asyncio.gather(*self._submit(method, args, kwargs)))
