"""The frozen reference policy for the KL term: the starting weights, held in host memory.

The reference is the model the run started from. Its weights stay off the accelerator (host memory,
pinned on GPU) and are swapped into the training model only for the reference forward of a step;
the training weights wait in host memory meanwhile. So a reference costs one model's host memory
and two copies of this rank's shard per step, not a second model on the device.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
    copy.copy_(tensor.detach())
    return copy


class ReferenceWeights:
    """This rank's shard of the reference weights (``chunks``' trained parameters when it was made;
    frozen ones, such as a LoRA run's base, never leave their starting values: with LoRA only the
    adapters are held and swapped)."""

    def __init__(self, chunks: list):
        self.params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self.weights = [_host_copy(p) for p in self.params]

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the reference weights inside the block, its own weights again after."""
        own = [_host_copy(p) for p in self.params]
        try:
            with torch.no_grad():
                for param, ref in zip(self.params, self.weights):
                    param.copy_(ref, non_blocking=True)
            yield
        finally:
            with torch.no_grad():
                for param, mine in zip(self.params, own):
                    param.copy_(mine, non_blocking=True)
