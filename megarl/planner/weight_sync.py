"""Bytes moved per weight sync and its time over the trainer->engine link.

Every engine receives the full main model (HF tensors, ``model.dtype``; the MTP modules are not
synced) in buckets of at most ``sync.bucket_mb`` MiB; a tensor larger than a bucket travels alone.
The estimate is the transfer alone, ``bytes * 8 / link_gbps``: a pipelined broadcast delivers the
model to all engines in about the time one receives it; gathering TP/EP shards and the engine's
load are not included.

With LoRA synced as adapters (``lora.enabled``, ``lora.sync=adapter``) an engine receives the
adapters alone, in HF PEFT form (:mod:`megarl.planner.lora`): one ``adapter_model.safetensors``
the trainer writes and every engine loads (megarl/sync/adapter.py), not bucketed. The time is
projected the same way, at ``sync.link_gbps``. ``lora.sync=merged`` moves the full model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig

from megarl.config.errors import ConfigError
from megarl.planner.arch import Arch
from megarl.planner.lora import LoraPlan
from megarl.planner.params import count_params, embedding_params, expert_params, head_params
from megarl.planner.units import dtype_bytes

MIB = 2**20


@dataclass(frozen=True)
class WeightSyncPlan:
    bytes_per_sync: int  # bytes one engine receives
    buckets: int  # buckets of at most bucket_mb MiB
    largest_tensor_bytes: int
    seconds: float  # transfer time at link_gbps
    payload: str = "model"  # model | adapter (LoRA adapters alone) | merged (the model with LoRA merged)


def largest_tensor_params(arch: Arch) -> int:
    """The largest single HF tensor: embedding/head, or one expert's gate/up/down projection."""
    return max(embedding_params(arch), head_params(arch), expert_params(arch) // 3)


def weight_sync_plan(arch: Arch, cfg: DictConfig, lora: LoraPlan | None = None) -> WeightSyncPlan:
    """``lora``: the recipe's adapters (:func:`megarl.planner.lora.lora_plan`), None without LoRA."""
    size = dtype_bytes(cfg.model.dtype)
    bucket = cfg.sync.bucket_mb * MIB
    if bucket <= 0 or cfg.sync.link_gbps <= 0:
        raise ConfigError(f"sync: bucket_mb and link_gbps must be > 0, "
                          f"got {cfg.sync.bucket_mb} and {cfg.sync.link_gbps}")
    if lora is not None and lora.sync == "adapter":
        nbytes, buckets, largest, payload = lora.synced_bytes, 1, lora.largest_tensor_bytes, "adapter"
    else:
        nbytes = count_params(arch).total * size
        buckets, largest = math.ceil(nbytes / bucket), largest_tensor_params(arch) * size
        payload = "model" if lora is None else "merged"
    return WeightSyncPlan(bytes_per_sync=nbytes, buckets=buckets, largest_tensor_bytes=largest,
                          seconds=nbytes * 8 / (cfg.sync.link_gbps * 1e9), payload=payload)
