"""The trainer ranks of a run and what a resume restores.

:func:`start_trainer` starts the ranks (one Ray actor each); :func:`build_and_resume` builds the model
and optimizer on them from the starting checkpoint and, when ``trainer.resume`` is set and the run
directory has a checkpoint, loads its latest one: the trainer state, and the data position and sample
ledger saved with it (:class:`Resumed`).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from megarl.config.components import critic_settings, model_settings, optimizer_settings
from megarl.parallel import Layout
from megarl.pipeline.carried import CarriedRollouts
from megarl.pipeline.ledger import Ledger
from megarl.platform.description import Platform
from megarl.tasks.prompts import Prompt
from megarl.trainer.actor import RankDevices, TrainerGroup
from megarl.trainer.checkpoint import latest_step

log = logging.getLogger(__name__)


@dataclass
class Resumed:
    """Where the run starts: its last completed step (0 for a new run), the sample ledger, and the
    data position saved with the checkpoint (None for a new run): the prompt source's state, the
    prompts to draw again (``requeue``: (index, prompt) pairs), the next prompt index and the rollouts
    the checkpoint carries (``carried``)."""

    step: int = 0
    ledger: Ledger = field(default_factory=Ledger)
    position: dict | None = None

    @property
    def requeue(self) -> list[tuple[int, Prompt]]:
        return [(i, Prompt(**fields)) for i, fields in self.position["requeue"]] if self.position else []

    @property
    def next_index(self) -> int:
        return self.position["next_index"] if self.position else 0

    @property
    def carried(self) -> tuple[CarriedRollouts, dict[int, Prompt]] | None:
        """The rollouts the checkpoint carries and the buffered groups' prompts (None: none)."""
        if not self.position or "carried" not in self.position:
            return None
        return CarriedRollouts.from_plain(self.position["carried"])


def checkpoint_dir(cfg: DictConfig) -> Path:
    """Where the run ``cfg`` keeps its trainer checkpoints."""
    return Path(cfg.logging.run_dir) / "checkpoints"


def start_trainer(cfg: DictConfig, layout: Layout, stack: contextlib.AsyncExitStack, platform: Platform,
                  group: type[TrainerGroup] = TrainerGroup) -> TrainerGroup:
    """The trainer ranks of ``layout`` on ``platform`` (a GPU each on CUDA, filling nodes of
    ``cluster.gpus_per_node`` in rank order), placed and starting (:func:`build_and_resume` waits for
    them, so that the engines launch meanwhile); shut down when ``stack`` closes, kept warm for a later
    group only when the run ends without a failure (a rank may be stuck after one). ``group``: the
    :class:`TrainerGroup` (sub)class whose ranks run."""
    devices = RankDevices(platform.is_cuda, cfg.cluster.gpus_per_node)
    trainer = group(layout, backend=cfg.parallel.backend, seed=cfg.trainer.seed, wait=False, devices=devices)
    stack.push(lambda failure, *_: trainer.shutdown(keep=failure is None))
    return trainer


async def build_and_resume(trainer: TrainerGroup, cfg: DictConfig, start_checkpoint: str) -> Resumed:
    """Once the ranks of :func:`start_trainer` joined, build the model and optimizer on every rank from
    ``start_checkpoint`` (and the critic with ``critic.enabled``), then load the run's newest
    complete checkpoint when ``trainer.resume`` is set and one was saved (``latest`` exists: a
    CheckpointError naming the directory when none of its checkpoints is complete); where the run starts."""
    t = cfg.trainer
    await trainer.joined()
    await trainer.build(start_checkpoint, optimizer_settings(cfg, updates_per_step=t.updates_per_step),
                        model_settings(cfg), critic_settings(cfg, start_checkpoint))
    if not (t.resume and latest_step(checkpoint_dir(cfg)) is not None):
        return Resumed()
    loaded = await trainer.load_checkpoint(str(checkpoint_dir(cfg)))
    if loaded.skipped:  # newer checkpoints failed their completion record's check
        log.warning("resuming at step %d from %s, the newest complete checkpoint; skipped %s", loaded.step,
                    loaded.path, "; ".join(loaded.skipped))
    else:
        log.info("resuming at step %d from %s", loaded.step, loaded.path)
    return Resumed(step=loaded.step, ledger=Ledger.from_state_dict(loaded.data_position["ledger"]),
                   position=loaded.data_position)
