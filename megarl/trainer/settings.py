"""The trainer's sections of the run config: ``trainer`` (:class:`TrainerConfig`, the optimizer's keys
:class:`OptimizerConfig` and the step's), ``critic`` (:class:`CriticConfig`) and ``warmup``
(:class:`WarmupConfig`); the run config (:mod:`megarl.config.schema`) nests them."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from megarl.fields import setting

DTYPES = ("float32", "bfloat16", "float16")  # model.dtype
LR_DECAY_STYLES = ("constant", "linear", "cosine")  # trainer.lr_decay_style (megatron-core's schedules)


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer's keys of the ``trainer`` section (``megarl/trainer/optimizer.py`` extends it with what
    a run derives: the decay length and the dtype)."""

    lr: float = setting(1e-3, ge=0)
    min_lr: float = setting(0.0, ge=0)
    lr_warmup_steps: int = setting(0, ge=0)
    lr_decay_style: str = setting("constant", choices=LR_DECAY_STYLES)  # constant | linear | cosine
    weight_decay: float = setting(0.0, ge=0)
    adam_beta1: float = setting(0.9, ge=0, lt=1)
    adam_beta2: float = setting(0.99, ge=0, lt=1)
    adam_eps: float = setting(1e-8, gt=0)
    clip_grad: float = setting(1.0, ge=0)
    use_distributed_optimizer: bool = True
    optimizer_cpu_offload: bool = False  # fp32 master weights and Adam moments in host memory (megatron-core)


@dataclass(frozen=True)
class TrainerConfig(OptimizerConfig):
    # optimizer steps per RL step: the batch's prompt groups split into this many mini-batches, one update
    # each (slime's --num-steps-per-rollout; verl's ppo_mini_batch_size = batch / this)
    updates_per_step: int = setting(1, ge=1)
    # token budget of one micro-batch (packed: about this many real tokens)
    max_tokens_per_microbatch: int = setting(4096, ge=1)
    pack_sequences: bool = True  # packed (THD) micro-batches, DP ranks balanced by tokens; false: right-padded rows
    recompute: Recompute = Recompute.none
    recompute_num_layers: Optional[int] = setting(None, ge=1)
    gpu_memory_gb: float = setting(80.0, gt=0)  # per-device memory the planner checks layouts against
    seed: int = setting(1234, ge=0)
    save_interval: int = setting(0, ge=0)  # steps between checkpoints (run_dir/checkpoints); 0 = only at the end
    # continue from run_dir/checkpoints when it holds one (data position and counts too); false: start over, the old
    # run's checkpoints, metrics and event files moved to run_dir/previous/<time>/
    resume: bool = True
    keep_checkpoints: int = setting(3, ge=0)  # the newest checkpoints kept in run_dir/checkpoints; 0 = every one
    # planner: per-device GB for CUDA context, NCCL buffers, fragmentation
    reserved_memory_gb: float = setting(4.0, ge=0)


@dataclass(frozen=True)
class CriticConfig(OptimizerConfig):
    """PPO's value model (``algorithm.advantage=gae``, megarl/trainer/critic.py): the policy's architecture with a
    scalar head, on the trainer ranks beside the policy (same layout), with the optimizer keys above of its own
    and a checkpoint beside the policy's in every run checkpoint."""

    enabled: bool = False  # build and train the critic (required by, and only with, algorithm.advantage=gae)
    hf_path: Optional[str] = None  # HF checkpoint of its backbone (the head starts fresh); None = the policy's start
    value_clip: float = setting(0.5, gt=0)  # clip range of the value loss around the values before the step


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm-up on synthetic arithmetic problems (task.name=arithmetic; the tiny demos'
    starting point). Off by default: RL starts from model.hf_path."""

    steps: int = setting(0, ge=0)  # > 0: RL starts from save_hf_path, made by this many warm-up steps when absent
    batch_size: int = setting(64, ge=1)
    lr: float = setting(1e-3, ge=0)
    log_interval: int = setting(10, ge=1)
    save_hf_path: str = "checkpoints/warmup_hf"  # where the warmed-up HF checkpoint is written
    tool_fraction: float = setting(0.5, ge=0, le=1)  # task.env=calculator: share of warm-up examples that call the tool
