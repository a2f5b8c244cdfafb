"""Where the trainer's tensors live: a micro-batch goes to its model's device when its forward step
runs (:func:`megarl.trainer.rl_step.on_device`), and every collective runs on tensors of its process
group's device (NCCL: the rank's CUDA device; gloo: the host)."""
from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def model_device(chunks: list) -> torch.device:
    """The device of the model chunks' parameters (all chunks of a rank share one)."""
    for chunk in chunks:
        for param in chunk.parameters():
            return param.device
    raise ValueError("the model chunks hold no parameters")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group`` (None: the default group) reduces: the current CUDA device for
    NCCL, the host otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(tensor: T, device: torch.device) -> T:
    """``tensor`` on ``device`` (None stays None). A host tensor bound for CUDA (an expanded view too) is
    staged through pinned memory and copied without blocking the host (the stream orders it before its
    first use)."""
    if tensor is None or tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":  # pinning needs memory without overlaps
        return tensor.contiguous().pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
